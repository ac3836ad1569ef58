"""The app's Features (SAE) page (issue 66, item 8) through streamlit.testing: an SAE trained on the page is the
library's (same seed, same scenes), the features it shows are ``vl.sae_features``'s over the sidebar's scenes, the
writers and the ablation draw; an SAE read from a file is browsed the same way; a bad path shows why and the page
keeps working."""
from __future__ import annotations

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import vitlens as vl
from test_app import APP, chart, problems
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from vitlens.sae import save_sae

PAGE = "Features (SAE)"


def opened() -> AppTest:
    """The app on its defaults (ref-vit, 8 held-out scenes), the Features page open with a small SAE's settings."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.slider(key="n-shapes").set_value(8).run()
    at.radio(key="view").set_value(PAGE).run()
    at.selectbox(key="sae-size").set_value(64)
    at.number_input(key="sae-k").set_value(4)
    at.number_input(key="sae-epochs").set_value(1)
    at.slider(key="sae-scenes").set_value(100).run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    return at


def values(v) -> np.ndarray:
    """A Plotly JSON array (a list, or base64 {"dtype", "bdata"})."""
    import base64

    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v, dtype=float)


def figure(at: AppTest, title: str) -> dict:
    """The page's figure whose title holds ``title``."""
    for i in range(len(at.get("plotly_chart"))):
        fig = chart(at, i)
        if title in fig["layout"].get("title", {}).get("text", ""):
            return fig
    raise AssertionError(f"no figure titled {title!r}")


@pytest.fixture(scope="module")
def library():
    """What the page should show: the same SAE trained by the library (seeded), its features over the same scenes."""
    m = vl.load_model("ref-vit")
    sae = vl.train_sae(m, list(generate(100, seed=7).images), site="blocks.3.hook_resid_post", n_features=64, k=4,
                    tokens="patches", epochs=1).sae
    scenes = generate(8, seed=HELD_OUT_SEED)
    return vl.sae_features(m, sae, list(scenes.images), labels=scenes.labels, top=8), sae


@pytest.fixture(scope="module")
def trained() -> AppTest:
    at = opened()
    at.checkbox(key="sae-train-on").check().run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    return at


def test_the_sae_trained_on_the_page_and_its_features_are_the_librarys(trained: AppTest, library) -> None:
    r, _ = library
    assert any(c.value == r.summary() for c in trained.caption), [c.value for c in trained.caption]
    freq = figure(trained, "activation frequency")
    np.testing.assert_allclose(np.sort(values(freq["data"][0]["x"])), np.sort(np.log10(r.frequency[r.frequency > 0])))
    first = int(r.order("frequency")[0])
    assert trained.selectbox(key="sae-feature").value == first
    assert f"Feature {first} at" in figure(trained, "top")["layout"]["title"]["text"]
    writers = figure(trained, "Who writes feature")
    assert sum(len(values(t["x"])) for t in writers["data"] if t["type"] == "scatter") == 4 * 8  # the heads of blocks 1 to 4


def test_the_order_by_logit_effect_and_the_ablation_show_the_librarys_edit(trained: AppTest, library) -> None:
    trained.radio(key="sae-order").set_value("logit effect").run()
    options = trained.selectbox(key="sae-feature").options  # the labels, in the new order (the feature picked stays)
    r, sae = library
    assert [o.split(":")[0] for o in options] == [f"feature {f}" for f in r.order("logit_effect")]
    trained.checkbox(key="sae-edit-on").check().run()
    assert problems(trained) == [] and not trained.error, [e.value for e in trained.error]
    fig = figure(trained, "ablated at blocks.3.hook_resid_post")
    assert any(t["type"] == "bar" for t in fig["data"])
    feature = int(trained.selectbox(key="sae-feature").value)
    picked = [int(i) for i in r.top_images[r.row(feature)] if i >= 0][:4]
    scenes = generate(8, seed=HELD_OUT_SEED)
    edit = vl.sae_intervene(vl.load_model("ref-vit"), sae, [scenes.images[i] for i in picked], feature)
    assert any(c.value == edit.summary() for c in trained.caption), [c.value for c in trained.caption]
    table = next(d.value for d in trained.dataframe if "logit_after" in d.value.columns)
    np.testing.assert_allclose(table["logit_after"].to_numpy(), edit.to_pandas()["logit_after"].to_numpy())
    assert np.abs(edit.logits_after - edit.logits_before).max() > 0  # a middle block's edit reaches the head


def test_an_sae_file_is_browsed_and_a_bad_path_says_why(tmp_path) -> None:
    m = vl.load_model("ref-vit")
    sae = vl.train_sae(m, list(generate(40, seed=7).images), site="blocks.2.hook_resid_post", n_features=32, k=2,
                    tokens="all", epochs=1).sae
    folder = save_sae(sae, tmp_path / "sae")
    at = opened()
    at.radio(key="sae-source").set_value("Load an SAE file").run()
    at.text_input(key="sae-path").input(str(tmp_path / "missing")).run()
    assert problems(at) == [] and at.error, "a missing file is the library's message"
    at.text_input(key="sae-path").input(str(folder)).run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    assert "blocks.2.hook_resid_post" in figure(at, "activation frequency")["layout"]["title"]["text"]
