"""The capture path says what it does (issue 30, section 2): a family's install receives one explicit
``CaptureRequest``; ``capture_plan`` is the one planning entry point every stream asks; an ``Adapter``
hands every method it does not write to the inner family (so an OpenCLIP tower on a timm trunk is
captured by query rows as its trunk is); rollout from an attention pool installs its own hooks; the
Grad-CAM layer is the family's to name."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.engine.capture import AttentionCapture
from vitlens.views.distance import AttentionDistanceAccumulator
from vitlens.views.rollout import RolloutAccumulator
from vitlens.engine import plan as plan_module
from vitlens.families import FAMILIES, Adapter, CaptureAbilities, CaptureRequest, Family, family_of
from vitlens.families.base import ADAPTED

from conftest import get_model
from test_families import tiny_open_clip


class Wrapped(nn.Module):
    """A module of our own around a timm ViT (no family names it)."""

    def __init__(self) -> None:
        super().__init__()
        import timm

        torch.manual_seed(0)
        self.backbone = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32,
                                          patch_size=8, depth=2)
        self.head = nn.Linear(192, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class WrappedFamily(Adapter):
    """An adapter that writes only what decides whether it reads a model, and the output."""

    name = "test-wrapped"

    def inner(self, model: nn.Module) -> tuple[nn.Module, Family]:
        return model.backbone, family_of(model.backbone)

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, Wrapped)

    def check(self, model: nn.Module, name: str) -> None:
        family_of(model.backbone, name)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)


@pytest.fixture()
def wrapped_family():
    family = WrappedFamily()
    FAMILIES.insert(0, family)
    yield family
    FAMILIES.remove(family)


def test_an_adapter_hands_every_model_method_it_does_not_write_to_the_inner_family(wrapped_family):
    # the list is derived from Family: every public method whose first argument is the model
    assert {"abilities", "attention_input", "spec", "install_side", "install_inline", "install_pool", "pixel_filters",
            "position_table", "grid_for", "data_config", "logits"} <= set(ADAPTED)
    assert "matches" not in ADAPTED and "check" not in ADAPTED and "head_outputs" not in ADAPTED
    module = Wrapped().eval()
    m = vl.LoadedModel.from_module(module, name="wrapped")
    inner = family_of(module.backbone)
    assert m.family is wrapped_family and m.spec.grid == (4, 4)
    assert wrapped_family.abilities(module) == inner.abilities(module.backbone)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with vl.capture_attention(m) as outer_cap:
        out = m.logits(x)
    with vl.capture_attention(module.backbone) as inner_cap:
        module.backbone(x)
    assert out.shape == (2, 3)  # the adapter's own output: the wrapper's head
    for a, b in zip(outer_cap.maps, inner_cap.maps, strict=True):
        assert torch.equal(a, b)


def test_an_open_clip_tower_on_a_timm_trunk_is_captured_by_query_rows_as_its_trunk_is():
    m = vl.LoadedModel.from_module(tiny_open_clip(timm_trunk=True).eval(), name="oc-timm")
    trunk = get_model("vit_tiny_patch16_224")  # any timm ViT: the ability is the timm family's
    assert m.family.name == "openclip-timm"
    assert m.family.abilities(m.model) == trunk.family.abilities(trunk.model)
    assert m.family.abilities(m.model).side_rows and m.family.abilities(m.model).inline_rows
    # a budget below one block's map: the plan computes by query rows, as for the trunk (it made whole maps before)
    plan = vl.engine.capture_plan(m, 2, memory_budget_mb=4 * 2 * 2 * 17 * 5 / 2**20)
    assert plan.mode == "inline" and plan.query_rows == 5
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    whole = vl.attention_distance(m, x)
    by_rows = vl.attention_distance(m, x, memory_budget_mb=4 * 2 * 2 * 17 * 5 / 2**20)
    # the same probabilities, reduced per row block instead of per map: float32 sums in another order
    np.testing.assert_allclose(by_rows.mean_px, whole.mean_px, rtol=1e-5, atol=1e-6)


class _Recording(Family):
    """A family that records the request its install gets (over a timm ViT)."""

    name = "test-recording"

    def __init__(self) -> None:
        self.requests: list[CaptureRequest] = []
        self.timm = family_of(get_model("vit_tiny_patch16_224").model)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles) -> None:
        self.requests.append(capture)
        self.timm.install_side(model, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles) -> None:
        self.requests.append(capture)
        self.timm.install_inline(model, capture, handles)

    def abilities(self, model: nn.Module) -> CaptureAbilities:
        return self.timm.abilities(model)


def test_a_family_install_receives_one_request_that_says_what_to_capture():
    m = get_model("vit_tiny_patch16_224")
    family = _Recording()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    cap = AttentionCapture(m.model, mode="inline", detach=False)
    cap.family = family
    with cap, torch.no_grad():
        m.model(x)
    side = AttentionCapture(m.model, mode="side", query_rows=50, consumers=[AttentionDistanceAccumulator.for_model(
        m.spec)])
    side.family = family
    with side:
        pass
    inline, by_rows = family.requests
    assert (inline.mode, inline.query_rows, inline.detach, inline.views) == ("inline", None, False, False)
    assert (by_rows.mode, by_rows.query_rows, by_rows.detach, by_rows.views) == ("side", 50, True, True)
    assert len(cap.maps) == 12
    # the request hands maps on, whole or by rows; sending_to keeps everything but the destination
    got = []
    request = CaptureRequest(lambda *a: got.append(a), mode="side", query_rows=3, views=True)
    request(0, torch.ones(1)), request(1, torch.ones(1), slice(0, 3))
    assert [len(a) for a in got] == [2, 3]
    moved = request.sending_to(print)
    assert (moved.mode, moved.query_rows, moved.views, moved.emit) == ("side", 3, True, print)


def test_every_stream_plans_its_capture_through_capture_plan(monkeypatch, tiny):
    asked = []
    real = plan_module.capture_plan

    def recording(*args, **kwargs):
        plan = real(*args, **kwargs)
        asked.append((kwargs.get("mode"), kwargs.get("query_rows"), plan))
        return plan

    from vitlens.engine import stream

    monkeypatch.setattr(stream, "capture_plan", recording)
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    vl.stream_attention(tiny, x, [AttentionDistanceAccumulator.for_model(tiny.spec)])  # public default: side
    vl.stream_attention(tiny, x, [AttentionDistanceAccumulator.for_model(tiny.spec)], query_rows=64)
    vl.attention_distance(tiny, x)  # a view: the plan's own choice
    vl.prefix_diagnostics(tiny, x)
    vl.attention_maps(tiny, x, queries=[0])
    modes = [(mode, rows, p.mode, p.query_rows) for mode, rows, p in asked]
    assert modes[0] == ("side", None, "side", None)
    assert modes[1] == ("side", 64, "side", 64)
    assert modes[2][:2] == (None, None) and modes[2][2] == "inline"  # timm: inline by rows (one block of all rows)
    assert len(asked) == 5


def test_rollout_from_the_pool_installs_its_own_hooks_and_travels_without_the_model():
    m = vl.LoadedModel.from_module(tiny_open_clip(timm_trunk=True).eval(), name="oc-map")
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    want = vl.attention_rollout(m, x, source="pool")
    acc = RolloutAccumulator.for_model(m, source="pool")
    vl.stream_attention(m, x, [acc], capture_mode=None)  # the accumulator's hooks read the pool
    got = acc.result(m.spec)
    assert got.source_token == want.source_token == "attention pool"
    np.testing.assert_array_equal(got.maps, want.maps)
    travelled = pickle.loads(pickle.dumps(acc))
    assert travelled._model is None and travelled.source == "pool"
    with pytest.raises(vl.InvalidParameterError, match="for_model"):
        travelled.hooks()
    with pytest.raises(vl.InvalidParameterError, match="do not merge"):
        acc.merge(RolloutAccumulator.for_model(m))
    with pytest.raises(vl.InvalidParameterError, match="source must be"):
        RolloutAccumulator.for_model(m, source="token")


class _NamedNorm(Family):
    """A family over a timm ViT that names another child as its attention's input."""

    name = "test-named-norm"

    def __init__(self, child: str | None) -> None:
        self.child = child

    def attention_input(self, model: nn.Module, block: nn.Module) -> str | None:
        return self.child


def test_the_cam_layer_is_the_one_the_family_names(tiny):
    pytest.importorskip("pytorch_grad_cam")
    from types import SimpleNamespace

    from vitlens.attribution.cam import default_target_layer

    assert default_target_layer(tiny) == "blocks.11.norm1"
    other = SimpleNamespace(model=tiny.model, family=_NamedNorm("norm2"), block_names=tiny.block_names,
                            blocks=tiny.blocks)
    assert default_target_layer(other) == "blocks.11.norm2"
    with pytest.raises(vl.ViewNotAvailableError, match="target_layer="):
        default_target_layer(SimpleNamespace(model=tiny.model, family=_NamedNorm(None), block_names=tiny.block_names,
                                             blocks=tiny.blocks))
