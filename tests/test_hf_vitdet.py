"""Hugging Face ViTDet and SAM / SAM-HQ image encoders (issue 32): windowed layers (padded, no shift) and global
layers on one grid, checked as tests/test_sam.py checks timm's SAM: capture against the decomposed relative-position
attention written out here in float64 (side and inline, eager and sdpa), the outputs bit for bit under side capture,
the windows against a hand-written partition, distance and rollout against the dense float64 checks every windowed
model passes (tests/test_swin.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.windowed import WindowedDistanceResult

from test_swin import assert_distance_is_a_dense_float64_computation, assert_rollout_is_a_brute_force_dense_composition
from test_swin import hand_windows

transformers = pytest.importorskip("transformers")

#: a 7x7 grid of 8 px patches, windows of 3 (padded to 9x9: 9 windows, padding in the last row and column)
SIZE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, image_size=56, patch_size=8, window_size=3)


def _peaky(attns, g: torch.Generator) -> None:
    """Large random q/k weights and relative-position tables, so the attention is far from uniform."""
    with torch.no_grad():
        for attn in attns:
            attn.qkv.weight.normal_(0.0, 0.5, generator=g)
            attn.qkv.bias.normal_(0.0, 0.5, generator=g)
            attn.rel_pos_h.normal_(0.0, 0.5, generator=g)
            attn.rel_pos_w.normal_(0.0, 0.5, generator=g)


def tiny_vitdet(backbone: bool = False, pretrain: int = 56) -> torch.nn.Module:
    """A 4-layer ViTDet: layers 0 and 2 windowed, 1 and 3 global; position table at ``pretrain`` px."""
    torch.manual_seed(0)
    config = transformers.VitDetConfig(**SIZE, pretrain_image_size=pretrain, window_block_indices=[0, 2],
                                       use_relative_position_embeddings=True, mlp_ratio=2,
                                       out_features=["stage2", "stage4"] if backbone else None)
    model = (transformers.VitDetBackbone if backbone else transformers.VitDetModel)(config).eval()
    _peaky([layer.attention for layer in model.encoder.layer], torch.Generator().manual_seed(0))
    return model


def tiny_sam(implementation: str = "sdpa", hq: bool = False, whole: bool = False) -> torch.nn.Module:
    """A 4-layer SAM (or SAM-HQ) image encoder: layers 1 and 3 global, the others windowed; ``whole``: a SamModel
    (its vision encoder read, the prompt encoder and mask decoder kept)."""
    torch.manual_seed(0)
    prefix = "SamHQ" if hq else "Sam"
    vision = getattr(transformers, f"{prefix}VisionConfig")(**SIZE, global_attn_indexes=[1, 3], output_channels=16,
                                                             mlp_dim=64, use_rel_pos=True)
    if whole:
        config = getattr(transformers, f"{prefix}Config")(vision_config=vision.to_dict())
        model = getattr(transformers, f"{prefix}Model")._from_config(config, attn_implementation=implementation)
    else:
        model = getattr(transformers, f"{prefix}VisionModel")._from_config(vision, attn_implementation=implementation)
    model = model.eval()
    _peaky([layer.attn for layer in model.vision_encoder.layers], torch.Generator().manual_seed(0))
    return model


def images(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(1))


def reference_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The attention written out in float64 from what the layer hands its attention ([B_, h, w, C] windows, or the
    whole grid): softmax(q k^T / sqrt(d) + q . R_h[dy] + q . R_w[dx]) (Li et al. 2022's decomposed term, from the
    unscaled q; R at offset dy = y_q - y_k + h - 1), [B_, heads, N, N]."""
    b_, h, w, c = x.shape
    heads = int(getattr(attn, "num_heads", None) or attn.num_attention_heads)
    qkv = torch.nn.functional.linear(x.double().reshape(b_, h * w, c), attn.qkv.weight.double(),
                                     attn.qkv.bias.double())
    q, k, _v = qkv.reshape(b_, h * w, 3, heads, -1).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    assert attn.rel_pos_h.shape[0] == 2 * h - 1 and attn.rel_pos_w.shape[0] == 2 * w - 1  # no resampling
    rows, cols = torch.arange(h), torch.arange(w)
    rh = attn.rel_pos_h.double()[rows[:, None] - rows[None, :] + h - 1]  # [h, h, d]
    rw = attn.rel_pos_w.double()[cols[:, None] - cols[None, :] + w - 1]  # [w, w, d]
    qg = q.reshape(b_, heads, h, w, -1)
    bias = torch.einsum("bnyxd,ykd->bnyxk", qg, rh)[..., :, None] + torch.einsum("bnyxd,xkd->bnyxk", qg, rw)[
        ..., None, :]
    return (scores + bias.reshape(b_, heads, h * w, h * w)).softmax(-1)


def attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    if hasattr(model, "vision_encoder"):
        return [layer.attn for layer in model.vision_encoder.layers]
    return [layer.attention for layer in model.encoder.layer]


def output(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "vision_encoder"):
        return model.vision_encoder(pixel_values=x).last_hidden_state
    out = model(pixel_values=x)
    return out.feature_maps[-1] if hasattr(out, "feature_maps") else out.last_hidden_state


MODELS = {
    "vitdet": lambda: tiny_vitdet(),
    "vitdet-backbone": lambda: tiny_vitdet(backbone=True),
    "sam-sdpa": lambda: tiny_sam("sdpa"),
    "sam-eager": lambda: tiny_sam("eager"),
    "sam-model": lambda: tiny_sam("sdpa", whole=True),
    "sam-hq-sdpa": lambda: tiny_sam("sdpa", hq=True),
    "sam-hq-eager": lambda: tiny_sam("eager", hq=True),
}


@pytest.mark.parametrize("which", list(MODELS))
def test_the_windows_are_the_padded_partition_and_global_layers_one_window(which):
    m = vl.LoadedModel.from_module(MODELS[which](), name=which)
    assert m.spec.kind == "hierarchical" and m.family.name == ("hf-vitdet" if "vitdet" in which else "hf-sam")
    assert m.spec.grid == (7, 7) and m.spec.num_layers == 4 and m.spec.num_prefix_tokens == 0
    windows = m.family.windows(m.model, m.spec.image_size)
    kinds = ["window", "global", "window", "global"]
    assert [g.kind for g in windows] == kinds
    for g in windows:
        assert g.grid == (7, 7) and g.stride_px == (8, 8)
    # the official partition: pad to whole windows (bottom and right), windows and positions row-major
    np.testing.assert_array_equal(windows[0].index, hand_windows((7, 7), 3, 0))
    assert (windows[0].index == -1).sum() == 81 - 49
    np.testing.assert_array_equal(windows[1].index, np.arange(49)[None])
    # padding keys are zero tokens the models leave unmasked; the views attend only real tokens
    np.testing.assert_array_equal(windows[0].allowed, np.broadcast_to((windows[0].index >= 0)[:, None, :],
                                                                        (9, 9, 9)))


@pytest.mark.parametrize("mode", ["side", "inline"])
@pytest.mark.parametrize("which", list(MODELS))
def test_capture_is_the_layers_own_attention_and_leaves_the_outputs(which, mode):
    model = MODELS[which]()
    m = vl.LoadedModel.from_module(model, name=which)
    x = images()
    feeds: list[torch.Tensor] = []
    hooks = [a.register_forward_pre_hook(lambda _m, args, kwargs: feeds.append(
        args[0] if args else kwargs["hidden_states"]), with_kwargs=True) for a in attentions(model)]
    with torch.no_grad():
        plain = output(model, x)
        feeds.clear()
        with vl.capture_attention(m, mode=mode) as cap:
            out = output(model, x)
    for h in hooks:
        h.remove()
    if mode == "side" or "sdpa" not in which and which != "sam-model":
        assert torch.equal(out, plain)  # bit for bit (ViTDet and eager SAM: inline is the model's own path too)
    else:  # inline runs SAM's eager attention in place of sdpa: float rounding
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert len(cap.maps) == len(feeds) == 4
    for attn, feed, got in zip(attentions(model), feeds, cap.maps):
        want = reference_probs(attn, feed)
        assert got.shape == want.shape  # [B * windows, heads, N, N]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", ["vitdet", "sam-eager"])
def test_the_maps_are_what_the_model_returns_with_output_attentions(which):
    """Against each model's own eager attention as transformers returns it (output_attentions=True): ViTDet's
    [B * windows, heads, N, N]; SAM's recorded attentions, heads in the batch."""
    model = MODELS[which]()
    m = vl.LoadedModel.from_module(model, name=which)
    x = images(2)
    with torch.no_grad():
        own = (model.vision_encoder if hasattr(model, "vision_encoder") else model)(
            pixel_values=x, output_attentions=True).attentions
        with vl.capture_attention(m) as cap:
            output(model, x)
    assert len(own) == 4
    for got, want in zip(cap.maps, own):
        assert torch.equal(got, want.reshape(got.shape))


def test_inline_maps_carry_gradients_and_side_under_sdpa_equals_eager():
    x = images(1)
    sdpa, eager = tiny_sam("sdpa"), tiny_sam("eager")
    eager.load_state_dict(sdpa.state_dict())
    maps = []
    for model in (sdpa, eager):
        with torch.no_grad(), vl.capture_attention(vl.LoadedModel.from_module(model)) as cap:
            output(model, x)
        maps.append(cap.maps)
    for a, b in zip(*maps):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for model in (tiny_vitdet(), sdpa):
        m = vl.LoadedModel.from_module(model)
        pixels = x.clone().requires_grad_()  # (a loaded model's weights are frozen; gradients flow to the input)
        with vl.capture_attention(m, mode="inline", detach=False) as cap:
            out = output(model, pixels)
        assert all(p.requires_grad for p in cap.maps)
        (cap.maps[0][:, :, 0, 0].sum() + out.sum()).backward()
        assert pixels.grad is not None and pixels.grad.abs().sum() > 0


@pytest.mark.parametrize("which", ["vitdet", "sam-sdpa", "sam-hq-eager"])
def test_distance_and_rollout_are_the_dense_float64_computations(which):
    m = vl.LoadedModel.from_module(MODELS[which](), name=which)
    x = images(2)
    d = assert_distance_is_a_dense_float64_computation(m, x)
    assert d.kinds == ("window", "global", "window", "global")
    assert_rollout_is_a_brute_force_dense_composition(m, x)


@pytest.mark.parametrize("which", ["vitdet", "sam-model"])
def test_analyze_runs_and_the_weight_views_say_what_they_show(which):
    model = MODELS[which]()
    m = vl.LoadedModel.from_module(model, name=which)
    a = vl.analyze(m, images(2))
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 7, 7)
    assert a.filters is not None and a.position is not None
    assert m.logits(images(2)).shape == (2, 32 if "vitdet" in which else 16)


def test_a_vitdet_position_table_at_its_pretraining_size_is_read_on_its_own_grid():
    model = tiny_vitdet(pretrain=112)  # a 14x14 table, resampled by the model to the 7x7 grid
    m = vl.LoadedModel.from_module(model)
    table, grid = m.family.position_table(m.model, m.spec)
    assert grid == (14, 14) and table.shape == (1, 196, 32)
    assert torch.equal(table, model.embeddings.position_embeddings[:, 1:])


def test_other_classes_and_sizes_are_refused_in_one_line():
    from transformers.models.vitdet import modeling_vitdet

    model = tiny_vitdet()

    class Other(modeling_vitdet.VitDetAttention):
        pass

    layer = model.encoder.layer[1]
    own = layer.attention
    layer.attention = Other(model.config, input_size=(7, 7))
    with pytest.raises(vl.UnsupportedModelError, match="layer 1 is a VitDetLayer with Other"):
        vl.LoadedModel.from_module(model)
    layer.attention = own
    m = vl.LoadedModel.from_module(model)
    with pytest.raises(vl.UnsupportedModelError, match="built for 56x56"):
        m.family.spec(m.model, "tiny", input_size=(64, 64))


@pytest.mark.parametrize("which", ["vitdet", "sam-model"])
def test_an_hf_folder_loads_into_its_family(which, tmp_path):
    """``hf:FOLDER``: ViTDet (no sdpa implementation: built on its eager one), a whole SamModel (sdpa; its vision
    encoder read), with SAM's processor (longest side 1024 -> that square) read as the model's size."""
    import json

    model = MODELS[which]()
    model.save_pretrained(tmp_path)
    if which == "sam-model":
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "SamImageProcessor", "size": {"longest_edge": 56}, "resample": 2,
            "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "do_normalize": True}))
    m = vl.load_model(f"hf:{tmp_path}")
    assert m.family.name == ("hf-vitdet" if which == "vitdet" else "hf-sam") and m.spec.image_size == (56, 56)
    x = images(1)
    with torch.no_grad():
        torch.testing.assert_close(m.logits(x), output(model, x).mean(dim=(-2, -1)), rtol=0, atol=1e-6)
