"""The app's Components page (issue 51) through streamlit.testing: on the embedded reference ViT, the numbers it
shows (the layer x head table, the ledger, the logit lens, the token norms, the patching heatmap) are the library's
on the same image; a model the components refuse shows the message and the app keeps working."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from streamlit.testing.v1 import AppTest

import vitlens as vl
from test_app import APP, chart, heatmap_z, problems
from test_mvit_app import NAME, _register
from vitlens.reference.shapes import HELD_OUT_SEED, generate


@pytest.fixture(scope="module")
def page() -> AppTest:
    """The app on its defaults (ref-vit, the first held-out scene), the Components page open."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.radio(key="view").set_value("Components").run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    return at


def frame(at: AppTest, column: str):
    """The page's table that has this column (AppTest does not expose a dataframe's key)."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def test_the_components_page_shows_the_librarys_numbers(page: AppTest) -> None:
    m = vl.load_model("ref-vit")
    image = Image.fromarray(generate(1, seed=HELD_OUT_SEED).images[0])
    d = vl.decompose(m, [image])
    np.testing.assert_array_equal(frame(page, "head 1").to_numpy(), d.head_table(0))
    ledger = frame(page, "entry").set_index("entry")["value"]
    assert ledger["output (forward)"] == d.output[0] and ledger["ledger (relative gap)"] == d.ledger()[0]
    assert ledger["sum of parts"] == d.total()[0] and d.closes()
    assert any(f"ledger {d.ledger()[0]:.1e} (closes" in md.value for md in page.markdown)
    lens = vl.logit_lens(m, [image])
    np.testing.assert_array_equal(frame(page, "target logit")["target logit"].to_numpy(), lens.pooled[0])
    norms = vl.token_norms(m, [image])
    np.testing.assert_array_equal(frame(page, "max_norm")["max_norm"].to_numpy(), norms.norms[0].max(-1))
    # the layer x head figure and the head picked (the top head by default) are the table's and the head's map
    np.testing.assert_array_equal(heatmap_z(chart(page, 0)), d.head_table(0))
    l, h, _ = d.top_heads(1)[0]
    np.testing.assert_array_equal(heatmap_z(chart(page, 1)), d.head_map(l, h))
    # patching, on demand: the clean image against Gaussian noise of 0.5 x 255 (seed 0), as the page makes it
    page.checkbox(key="comp-patch-on").check().run()
    assert problems(page) == [] and not page.error, [e.value for e in page.error]
    clean = np.asarray(image.convert("RGB"))
    noisy = np.clip(clean + np.random.default_rng(0).normal(0.0, 127.5, clean.shape), 0, 255).astype(np.uint8)
    p = vl.patch_activations(m, [image], [noisy])
    fig = next(chart(page, i) for i in range(len(page.get("plotly_chart")))
               if "patching heads" in chart(page, i)["layout"]["title"]["text"])
    np.testing.assert_array_equal(heatmap_z(fig), p.restored(p.heads))
    tokens = next(chart(page, i) for i in range(len(page.get("plotly_chart")))
                  if "patching tokens" in chart(page, i)["layout"]["title"]["text"])
    np.testing.assert_array_equal(heatmap_z(tokens), p.restored(p.resid))  # layer x token


def test_a_model_the_components_refuse_shows_why_and_the_app_recovers(page: AppTest) -> None:
    _register()  # a tiny MViT v2 (hierarchical: no single residual stream), as the MViT app test builds it
    page.checkbox(key="comp-patch-on").check()  # the patching section on (whether or not the test above ran)
    page.session_state["m1-timm"] = NAME
    page.radio(key="m1-source").set_value("Name").run()
    errors = [e.value for e in page.error]
    assert problems(page) == [] and len(errors) == 4, errors  # each section says why, on its own
    assert all("MultiScaleVit" in e for e in errors), errors
    assert len(page.get("plotly_chart")) == 0
    page.radio(key="m1-source").set_value("Embedded").run()  # back to the reference ViT: the page works again
    assert problems(page) == [] and not page.error and len(page.get("plotly_chart")) >= 3
