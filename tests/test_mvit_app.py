"""An MViT v2 in the app (issue 32, pooling attention): the rollout through the poolings and one query's attention
on its block's pooled keys, the caption naming the key grid; distance per stage with each block's query and key
grids in the table."""
from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from test_app import APP, problems

NAME = "vitlens_test_tiny_mvit"


def _register() -> None:
    import timm
    from timm.models import register_model
    from timm.models._builder import build_model_with_cfg
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    if NAME in timm.list_models(NAME):
        return

    @register_model
    def vitlens_test_tiny_mvit(pretrained: bool = False, **kwargs):  # noqa: ANN202 (timm's entry point)
        cfg = MultiScaleVitCfg(depths=(1, 2, 1), embed_dim=8, num_heads=1, stride_q=((1, 1), (2, 2), (2, 2)))
        return build_model_with_cfg(MultiScaleVit, "mvitv2_tiny", False, model_cfg=cfg, img_size=64, **kwargs)


@pytest.fixture()
def mvit_app() -> AppTest:
    _register()
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.slider(key="n-shapes").set_value(8).run()
    at.radio(key="m1-source").set_value("Name").run()
    at.text_input(key="m1-timm").set_value(NAME).run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    return at


def test_an_mvit_in_the_app_shows_its_pooled_keys_and_the_grids_of_its_blocks(mvit_app):
    app = mvit_app
    assert "hierarchical" in app.sidebar.table[0].value.to_string()
    app.radio(key="view").set_value("Attention maps").run()
    assert problems(app) == [] and any(h.value == "One query's attention" for h in app.subheader)
    assert any("poolings" in c.value for c in app.caption)
    assert any("keys on a 4x4 grid" in c.value for c in app.caption)  # block 1: 16x16 queries, 4x4 keys
    app.slider(key="layer").set_value(4).run()  # block 4: stage 3, 4x4 queries over 8x8 keys
    assert problems(app) == []
    assert any("stage 3" in c.value and "4x4 grid" in c.value and "8x8 grid" in c.value for c in app.caption)
    app.session_state["n-dist"] = 4
    app.radio(key="view").set_value("Attention distance").run()
    assert problems(app) == []
    table = app.dataframe[0].value
    assert {"queries", "keys", "window_uniform_px"} <= set(table.columns)
    assert set(table["attention"]) == {"pooled"}
