"""Issue 64, the rest of round three: towers on ``nn.MultiheadAttention`` inside Hugging Face models (BridgeTower's
vision model), eager or sdpa towers with linear patch embeddings over flattened patches (Molmo2, Pix2Struct's patches
with their row and column ids), non-square inputs of RoPE towers (Pixtral, Qwen3-VL), packed towers read from what
they declare (GLM-4.1V's, Kimi K2.5's MoonViT, one written here), and refusals that name what they found. Each
reading is compared with the model's own attention (``output_attentions`` of its eager twin, or its own attention
calls recomputed in float64 from each block's input) within 1e-5, with queries and keys scaled so that the maps are
far from uniform and a wrong token order shows."""
from __future__ import annotations

import pytest
import torch

import vitlens as vl

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def _assert_captured(m: vl.LoadedModel, x: torch.Tensor, want: list[torch.Tensor], n: int) -> None:
    """Side and inline capture of ``m.forward(x)`` leave its output within TOL and give ``want`` ([2, 2, n, n] per
    block) within TOL."""
    with torch.no_grad():
        plain = m.forward(x)
        for mode in ("side", "inline"):
            with vl.capture_attention(m, mode=mode) as cap:
                out = m.forward(x)
            assert (out - plain).abs().max().item() < TOL and len(cap.maps) == len(want)
            for got, ref in zip(cap.maps, want):
                assert got.shape == (2, 2, n, n) and (got.double() - ref).abs().max().item() < TOL


def block_inputs(model: torch.nn.Module, modules: list[torch.nn.Module], run) -> list[tuple[tuple, dict]]:
    """Each module's call arguments during ``run()`` (a forward), in call order."""
    seen: list[tuple[tuple, dict]] = []
    hooks = [m.register_forward_pre_hook(lambda _m, a, kw: seen.append((a, kw)), with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return seen


# ------------------------------------------------------------------------------ A: nn.MultiheadAttention in HF


def _bridgetower() -> torch.nn.Module:
    from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerVisionModel

    cfg = transformers.BridgeTowerVisionConfig(num_hidden_layers=2, hidden_size=128, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = BridgeTowerVisionModel._from_config(cfg).eval()
    with torch.no_grad():
        for block in model.visual.transformer.resblocks:  # sharpened: queries and keys scaled
            block.attn.in_proj_weight[:256].mul_(6.0)
    return model


def test_bridgetower_tower_on_nn_multiheadattention_is_read_exactly_in_float64():
    model = _bridgetower()
    m = vl.LoadedModel.from_module(model, name="bridgetower", device="cpu")  # was refused: unknown attention class
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens, m.spec.has_class_token) == ("generic", (4, 4), 1,
                                                                                               True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    mhas = [b.attn for b in model.visual.transformer.resblocks]
    want = []
    for (args, _kw), mha in zip(block_inputs(model, mhas, lambda: model(x)), mhas):
        h = args[0].double().transpose(0, 1)  # sequence-first [T, B, D]
        w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
        q, k = (torch.nn.functional.linear(h, w[i * 128:(i + 1) * 128], b[i * 128:(i + 1) * 128])
                .unflatten(-1, (2, 64)).transpose(1, 2) for i in (0, 1))
        want.append(torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1))
    assert max(a.max().item() for a in want) > 0.5
    with torch.no_grad():
        plain = m.logits(x)
        for mode in ("side", "inline"):
            with vl.capture_attention(m, mode=mode) as cap:
                out = m.logits(x)
            assert len(cap.maps) == 2
            assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() < TOL
            for got, ref in zip(cap.maps, want):
                assert got.shape == (2, 2, 17, 17) and (got.double() - ref).abs().max().item() < TOL


def _sharpen_qk(model: torch.nn.Module, names: tuple[str, ...], std: float) -> torch.nn.Module:
    """Queries and keys drawn large (attention far from uniform: a wrong token order cannot hide in flat maps)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(names):
                weight.normal_(0.0, std, generator=g)
    return model


def _molmo2() -> torch.nn.Module:
    from transformers.models.molmo2.modeling_molmo2 import Molmo2VisionModel

    cfg = transformers.Molmo2VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                          num_key_value_heads=2, head_dim=16, intermediate_size=64, image_size=[32, 48],
                                          patch_size=8)
    torch.manual_seed(0)
    model = Molmo2VisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    return _sharpen_qk(model, ("q_proj.weight", "k_proj.weight"), 0.6)


def test_molmo2_linear_patches_over_flattened_patches_are_read_exact_against_eager():
    from test_whole_models import eager_tower
    from transformers.models.molmo2.image_processing_molmo2 import batch_pixels_to_patches

    model = _molmo2()
    m = vl.LoadedModel.from_module(model, name="molmo2", device="cpu")  # was refused: unknown attention class
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens, m.spec.has_pos_embed) == ("generic", (4, 6), 0,
                                                                                            True)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(7))
    patches = batch_pixels_to_patches(x.permute(0, 2, 3, 1), 8)  # as Molmo2's own image processor cuts them
    with torch.no_grad():
        own = eager_tower(model)(pixel_values=patches, output_attentions=True)
        plain = m.logits(x)
        with vl.capture_attention(m) as cap:
            out = m.logits(x)
    assert torch.equal(out, plain) and (out - own.pooler_output).abs().max().item() < TOL and len(cap.maps) == 2
    assert max(a.max().item() for a in own.attentions) > 0.5
    for got, ref in zip(cap.maps, own.attentions):
        assert got.shape == (2, 2, 24, 24) and (got - ref).abs().max().item() < TOL
    filters = m.family.pixel_filters(model, m.spec)[0]
    assert filters.shape == (32, 3, 8, 8)  # the linear layer's rows as filters of (row, column, channel) patches
    torch.testing.assert_close(filters[:, 2, 1, 5], model.patch_embedding.weight[:, (1 * 8 + 5) * 3 + 2].double())


def _pix2struct() -> torch.nn.Module:
    cfg = transformers.Pix2StructVisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, d_kv=16,
                                              d_ff=64, patch_embed_hidden_size=192, seq_len=16)
    torch.manual_seed(0)
    model = transformers.Pix2StructVisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # (its initializer_range is 1e-10: every weight drawn again, the queries and keys large)
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 0.3, generator=g)
    return _sharpen_qk(model, ("query.weight", "key.weight"), 0.25)


@pytest.mark.parametrize("size", [(24, 40), (32, 32)])
def test_pix2struct_flattened_patches_with_row_and_column_ids_are_read_exact_against_eager(size):
    from test_whole_models import eager_tower
    from transformers.models.pix2struct.image_processing_pix2struct import torch_extract_patches

    model = _pix2struct()
    m = vl.LoadedModel.from_module(model, name="pix2struct", device="cpu",  # was refused: unknown attention class
                                   data_config={"input_size": (3, *size)})
    grid = (size[0] // 8, size[1] // 8)
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens, m.spec.dynamic_img_size) == ("generic", grid, 0,
                                                                                               True)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(7))
    cut = torch_extract_patches(x, 8, 8).reshape(2, grid[0] * grid[1], -1)  # its processor's cut, ids in front
    rows, cols = torch.meshgrid(torch.arange(grid[0]) + 1.0, torch.arange(grid[1]) + 1.0, indexing="ij")
    ids = torch.stack([rows.flatten(), cols.flatten()], -1).expand(2, -1, -1)
    with torch.no_grad():
        own = eager_tower(model)(flattened_patches=torch.cat([ids, cut], -1), output_attentions=True)
        with vl.capture_attention(m) as cap:
            m.logits(x)
    assert max(a.max().item() for a in own.attentions) > 0.5 and len(cap.maps) == 2
    n = grid[0] * grid[1]
    for got, ref in zip(cap.maps, own.attentions):
        assert got.shape == (2, 2, n, n) and (got - ref).abs().max().item() < TOL


def test_pix2struct_beyond_its_row_and_column_ids_is_refused_in_one_line():
    with pytest.raises(vl.UnsupportedModelError, match="ids for at most 15 patches a side") as refusal:
        vl.LoadedModel.from_module(_pix2struct(), name="pix2struct", device="cpu",
                                   data_config={"input_size": (3, 32, 128)})
    assert "\n" not in str(refusal.value)


def test_pix2struct_at_a_size_of_no_whole_patches_is_refused_in_one_line():
    """A side that is not a whole number of patches is refused naming the patch (the cut raised torch's reshape
    error)."""
    with pytest.raises(vl.UnsupportedModelError, match="multiples of its 8 px patches; got 20x32") as refusal:
        m = vl.LoadedModel.from_module(_pix2struct(), name="pix2struct", device="cpu",
                                       data_config={"input_size": (3, 20, 32)})
        m.forward(torch.zeros(1, 3, 20, 32))
    assert "\n" not in str(refusal.value)


# ------------------------------------------------------------------------------ B: refusals that name what they found


def _got_ocr2() -> torch.nn.Module:
    from transformers.models.got_ocr2.modeling_got_ocr2 import GotOcr2VisionEncoder

    cfg = transformers.GotOcr2VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, mlp_dim=64,
                                           patch_size=8, image_size=64, window_size=2, global_attn_indexes=[1],
                                           output_channels=16)
    return GotOcr2VisionEncoder._from_config(cfg)


def _donut() -> torch.nn.Module:
    cfg = transformers.DonutSwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                       window_size=2)
    return transformers.DonutSwinModel._from_config(cfg)


def _focalnet() -> torch.nn.Module:
    return transformers.FocalNetModel(transformers.FocalNetConfig(image_size=32, patch_size=4, embed_dim=16,
                                                                  depths=[1, 1], hidden_sizes=[16, 32]))


def _groupvit() -> torch.nn.Module:
    cfg = transformers.GroupViTVisionConfig(hidden_size=32, intermediate_size=64, depths=[1, 1, 1],
                                            num_group_tokens=[4, 2, 0], num_output_groups=[4, 2, 2],
                                            num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8)
    return transformers.GroupViTVisionModel(cfg)


DIAGNOSED = {
    "got-ocr2": (_got_ocr2, r"attends in windows \(window_size=2 in its config, global attention only in blocks \[1\]"),
    "donut": (_donut, "windowed attention and patch merging"),
    "focalnet": (_focalnet, "no softmax: its blocks make no softmax and no scaled_dot_product_attention call"),
    "groupvit": (_groupvit, "several softmax calls each \\(GroupViTAssignAttention makes 2"),
}


@pytest.mark.parametrize("key", sorted(DIAGNOSED))
def test_an_unread_towers_refusal_names_what_its_attention_is(key):
    """The refusal said the same generic words for all of these ("... this one has neither")."""
    build, says = DIAGNOSED[key]
    torch.manual_seed(0)
    with pytest.raises(vl.UnsupportedModelError, match=says) as refusal:
        vl.LoadedModel.from_module(build().eval(), name=key, device="cpu")
    assert "\n" not in str(refusal.value) and "this one has neither" not in str(refusal.value)


# ------------------------------------------------------------------------------ C: RoPE towers at other sizes


def test_pixtral_at_a_non_square_size_is_read_exact_against_eager():
    """It was refused at 48x80 px ("built for 80x80 px inputs and cannot resample its position table"): it has no
    table, its 2-D RoPE is computed from each patch's (row, column)."""
    from test_whole_models import eager_tower

    cfg = transformers.PixtralVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, image_size=80, patch_size=16, head_dim=16)
    torch.manual_seed(0)
    model = transformers.PixtralVisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    _sharpen_qk(model, ("q_proj.weight", "k_proj.weight"), 0.6)
    for size in ((48, 80), (80, 48)):
        m = vl.LoadedModel.from_module(model, name="pixtral", device="cpu", data_config={"input_size": (3, *size)})
        grid = (size[0] // 16, size[1] // 16)
        assert (m.spec.grid, m.spec.image_size, m.spec.dynamic_img_size) == (grid, size, True)
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            own = [eager_tower(model)(pixel_values=img[None], output_attentions=True).attentions for img in x]
            with vl.capture_attention(m) as cap:
                m.forward(x)
        assert len(cap.maps) == 2 and max(a.max().item() for a in own[0]) > 0.5
        for layer, got in enumerate(cap.maps):
            want = torch.cat([o[layer] for o in own])
            assert got.shape == (2, 2, grid[0] * grid[1], grid[0] * grid[1])
            assert (got - want).abs().max().item() < TOL


def _qwen3vl() -> torch.nn.Module:
    cfg = transformers.Qwen3VLVisionConfig(hidden_size=32, depth=2, num_heads=2, intermediate_size=64, patch_size=16,
                                           out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[])
    torch.manual_seed(0)
    model = transformers.Qwen3VLVisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    return _sharpen_qk(model, ("qkv.weight",), 0.5)


def _row_major_from_merge_blocks(grid: tuple[int, int]) -> list[int]:
    """For each cell row-major, the index of its token in 2x2 merge-block order (blocks row-major, each row-major)."""
    gh, gw = grid
    return [((r // 2) * (gw // 2) + c // 2) * 4 + (r % 2) * 2 + c % 2 for r in range(gh) for c in range(gw)]


def qwen_vl_float64(model: torch.nn.Module, run, rotate=None) -> list[torch.Tensor]:
    """Each block's attention of a Qwen-VL-style tower (Qwen2-VL, Qwen3-VL, GLM-4.1V) in float64 from its own input,
    image by image (its ``cu_seqlens``), model order: q, k from its ``qkv`` and its modeling module's own
    ``apply_rotary_pos_emb_vision`` (``rotate``; Qwen3-VL's)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    apply_rotary_pos_emb_vision = rotate or apply_rotary_pos_emb_vision
    maps = []
    for block, (args, kw) in zip(model.blocks, block_inputs(model, [b.attn for b in model.blocks], run)):
        attn, hidden = block.attn, args[0].double()
        w = attn.qkv.weight.double()
        b = attn.qkv.bias.double() if attn.qkv.bias is not None else None
        q, k, _ = torch.nn.functional.linear(hidden, w, b).reshape(hidden.shape[0], 3, attn.num_heads, -1) \
            .permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *(t.double() for t in kw["position_embeddings"]))
        bounds = kw["cu_seqlens"].tolist()
        maps.append(torch.stack([torch.softmax(torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * attn.scaling, -1)
                                 for s, e in zip(bounds[:-1], bounds[1:])]))
    return maps


@pytest.mark.parametrize("loaded_at", [None, (3, 64, 96)])
def test_qwen3vl_at_a_non_square_size_is_read_exact_in_its_merge_block_order(loaded_at):
    """Fed 64x96 px after loading at its table's 64x64 px, it was refused ("the stated token layout has 16 tokens
    ... but the model's attention runs over 24"): the declared merge-block order now follows each forward's grid."""
    model = _qwen3vl()
    m = vl.LoadedModel.from_module(model, name="qwen3vl", device="cpu",
                                   data_config={"input_size": loaded_at} if loaded_at else None)
    assert m.spec.grid == ((4, 6) if loaded_at else (4, 4))
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(5))
    order = _row_major_from_merge_blocks((4, 6))
    want = [a[..., order, :][..., order] for a in qwen_vl_float64(model, lambda: m.forward(x))]
    assert max(a.max().item() for a in want) > 0.5
    assert len(want) == 2
    _assert_captured(m, x, want, 24)
    assert vl.attention_rollout(m, x[:1]).maps.shape == (1, 4, 6)


# ------------------------------------------------------------------------------ D: packed towers from what they declare


def _glm4v() -> torch.nn.Module:
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    cfg = transformers.Glm4vVisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=8,
                                         spatial_merge_size=2, out_hidden_size=32, image_size=32)
    torch.manual_seed(0)
    model = Glm4vVisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    return _sharpen_qk(model, ("qkv.weight",), 0.5)


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_glm4v_packed_tower_is_read_from_what_it_declares_exact_in_float64(size):
    """GLM-4.1V's vision tower (a Conv3d patch embedding fed flattened temporal patches beside its own
    ``embeddings``, ``grid_thw``, 2x2 merge blocks, one attention call per image) was refused as an unknown attention
    class; it declares what the Qwen-VL towers declare, and is read so, with no family of its own."""
    from transformers.models.glm4v.modeling_glm4v import apply_rotary_pos_emb_vision

    model = _glm4v()
    m = vl.LoadedModel.from_module(model, name="glm4v", device="cpu", data_config={"input_size": (3, *size)})
    grid = (size[0] // 8, size[1] // 8)
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", grid, 0)
    assert "permuted" in m.spec.describe()["token order"]
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(5))
    order = _row_major_from_merge_blocks(grid)
    want = [a[..., order, :][..., order]
            for a in qwen_vl_float64(model, lambda: m.forward(x), apply_rotary_pos_emb_vision)]
    assert max(a.max().item() for a in want) > 0.5
    n = grid[0] * grid[1]
    assert len(want) == 2
    _assert_captured(m, x, want, n)


def _kimi() -> torch.nn.Module:
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    cfg = Kimi_K25VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                               patch_size=8, pos_emb_height=4, pos_emb_width=4)
    torch.manual_seed(0)
    model = Kimi_K25VisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    return _sharpen_qk(model, ("q_proj.weight", "k_proj.weight"), 0.6)


def _kimi_float64(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """Each block's attention in float64 from its own input: q, k from its projections, rotated by its own cos and
    sin (``rotate_half``, as its ``apply_rotary_pos_emb_vision``, without its float32 cast), softmax(q k^T *
    scaling) within each image's ``cu_seqlens`` chunk, the images stacked, in the model's own order."""
    from transformers.models.kimi_k25.modeling_kimi_k25 import rotate_half

    attns = [layer.self_attn if hasattr(layer, "self_attn") else layer.attn for layer in model.layers]
    maps = []
    for attn, (args, kw) in zip(attns, block_inputs(model, attns, run)):
        hidden = (args[0] if args else kw["hidden_states"]).double()
        cos, sin = (t.double().unsqueeze(-2) for t in kw["position_embeddings"])
        q, k = (torch.nn.functional.linear(hidden, p.weight.double(), p.bias.double()).reshape(-1, attn.num_heads,
                                                                                           attn.head_dim)
                for p in (attn.q_proj, attn.k_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        bounds = kw["cu_seqlens"].tolist()
        maps.append(torch.stack([torch.softmax(torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * attn.scaling, -1)
                                 for s, e in zip(bounds[:-1], bounds[1:])]))
    return maps


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_kimi_moonvit_stacked_patches_are_read_from_what_it_declares_exact_in_float64(size):
    """Kimi K2.5's MoonViT takes a stack of patches [N, C, p, p] with grid_thw, its tokens row-major (position ids of
    merge size 1), one attention call per image; it was refused as an unknown attention class."""
    model = _kimi()
    m = vl.LoadedModel.from_module(model, name="moonvit", device="cpu", data_config={"input_size": (3, *size)})
    grid = (size[0] // 8, size[1] // 8)
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", grid, 0)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(5))
    want = _kimi_float64(model, lambda: m.forward(x))
    assert max(a.max().item() for a in want) > 0.5
    n = grid[0] * grid[1]
    assert len(want) == 2
    _assert_captured(m, x, want, n)


def test_a_packed_tower_whose_patch_layout_is_not_declared_is_refused_in_one_line_naming_it():
    """Cosmos3-Edge's vision tower (transformers 5.24 has it) embeds packed patches with a linear layer that declares
    neither the order of a patch's pixels nor of the patches; it was refused in the general words."""
    from transformers.models.cosmos3_edge.configuration_cosmos3_edge import Cosmos3EdgeVisionConfig
    from transformers.models.cosmos3_edge.modeling_cosmos3_edge import Cosmos3EdgeVisionModel

    cfg = Cosmos3EdgeVisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  patch_size=8)
    model = Cosmos3EdgeVisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(vl.UnsupportedModelError, match=r"packed vision tower \(its forward takes grid_thw\) whose "
                       r"patches enter through embeddings.patch_embedding \(nn.Linear, 192 inputs\)") as refusal:
        vl.LoadedModel.from_module(model, name="cosmos3-edge", device="cpu")
    assert "\n" not in str(refusal.value)


class _OwnPackedAttention(torch.nn.Module):
    """One SDPA call per image over its chunk of the packed sequence (its ``cu_seqlens``)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
        out = [torch.nn.functional.scaled_dot_product_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e])[0]
               for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        return self.proj(torch.cat(out, 1).transpose(0, 1).reshape(x.shape[0], -1))


class _OwnPackedBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(dim), _OwnPackedAttention(dim, heads)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        return x + self.attn(self.norm(x), cu_seqlens)


class _OwnPatchEmbed(torch.nn.Module):
    def __init__(self, dim: int, patch: int, temporal: int) -> None:
        super().__init__()
        self.temporal_patch_size, self.patch = temporal, patch
        self.proj = torch.nn.Conv3d(3, dim, (temporal, patch, patch), (temporal, patch, patch))

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        p, t = self.patch, self.temporal_patch_size
        return self.proj(flat.reshape(-1, 3, t, p, p)).reshape(flat.shape[0], -1)


class OwnPackedTower(torch.nn.Module):
    """A packed tower written here, the transformers way (a ``config``, a forward taking flattened temporal patches
    [N, C·t·p·p] with ``grid_thw``, 2x2 merge-block order, one attention call per image), in no family and a plain
    module of this file, not transformers' (it had to pose as ``transformers.own_packed`` to be read)."""

    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(model_type="own_packed", num_hidden_layers=2, hidden_size=32, patch_size=8,
                                      image_size=32)
        self.spatial_merge_size = 2
        self.patch_embed = _OwnPatchEmbed(32, 8, 2)
        self.blocks = torch.nn.ModuleList([_OwnPackedBlock(32, 2) for _ in range(2)])

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor):
        from types import SimpleNamespace

        x = self.patch_embed(hidden_states)
        sizes = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
        for block in self.blocks:
            x = block(x, bounds)
        return SimpleNamespace(last_hidden_state=x, pooler_output=x)


def test_a_packed_tower_written_here_is_read_from_what_it_declares_exact_in_float64():
    torch.manual_seed(0)
    model = _sharpen_qk(OwnPackedTower().eval(), ("qkv.weight",), 0.6)
    m = vl.LoadedModel.from_module(model, name="own-packed", device="cpu", data_config={"input_size": (3, 32, 48)})
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", (4, 6), 0)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(5))
    want = []
    for block, (args, _kw) in zip(model.blocks, block_inputs(model, [b.attn for b in model.blocks],
                                                               lambda: m.forward(x))):
        attn, h = block.attn, args[0].double()
        q, k, _ = torch.nn.functional.linear(h, attn.qkv.weight.double(), attn.qkv.bias.double()) \
            .reshape(h.shape[0], 3, 2, 16).permute(1, 2, 0, 3).unbind(0)
        want.append(torch.stack([torch.softmax(q[:, s:s + 24] @ k[:, s:s + 24].transpose(-1, -2) / 4.0, -1)
                                 for s in (0, 24)]))
    order = _row_major_from_merge_blocks((4, 6))
    want = [a[..., order, :][..., order] for a in want]
    assert max(a.max().item() for a in want) > 0.5
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.forward(x)
    assert len(cap.maps) == 2
    for got, ref in zip(cap.maps, want):
        assert got.shape == (2, 2, 24, 24) and (got.double() - ref).abs().max().item() < TOL


def _stacked_reference(kind: str, build, x: torch.Tensor, patch: int) -> list[torch.Tensor]:
    """The tower's own eager attention on ``x`` fed the way its processor hands images (written here, not by
    vitlens): each image's patches row-major, in the shape its forward documents, ``grid_thw`` (1, rows, columns)."""
    eager = build("eager").eval()
    b, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    stack = x.reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c, patch, patch)
    inputs = {"grid_thw": torch.tensor([[1, gh, gw]] * b)}
    if kind == "videollama3":
        inputs.update(pixel_values=stack.reshape(b * gh * gw, -1), merge_sizes=torch.ones(b, dtype=torch.long))
    elif kind in ("hunyuan-vl", "hy-v4-vl"):
        inputs.update(pixel_values=stack.reshape(b * gh * gw, -1))
    else:  # PaddleOCR-VL: [1, N, C, p, p]
        inputs.update(pixel_values=stack[None])
    attns = [mod for mod in eager.modules() if hasattr(mod, "q_proj") and hasattr(mod, "k_proj")]
    if kind in ("hunyuan-vl", "hy-v4-vl"):  # (their eager attention drops its weights: recomputed in float64, no RoPE)
        def softmaxes(mod: torch.nn.Module, kw: dict) -> torch.Tensor:
            h, bounds = kw["hidden_states"][0].double(), kw["cu_seqlens"].tolist()
            q, k = (torch.nn.functional.linear(h, lin.weight.double(), lin.bias.double())
                    .reshape(h.shape[0], mod.num_heads, -1).transpose(0, 1) for lin in (mod.q_proj, mod.k_proj))
            return torch.stack([torch.softmax(q[:, s:e] @ k[:, s:e].transpose(-1, -2) * mod.scaling, -1)
                                for s, e in zip(bounds[:-1], bounds[1:])])
        return [softmaxes(mod, kw) for mod, (_a, kw) in zip(attns, block_inputs(eager, attns,
                                                                                 lambda: eager(**inputs)))]
    weights: list[torch.Tensor] = []  # each layer's eager softmax: one [1, H, n, n] per image (its own call each)
    hooks = [mod.register_forward_hook(lambda _m, _a, out: weights.append(torch.cat(list(out[1]), 0)))
             for mod in attns]
    try:
        with torch.no_grad():
            eager(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return weights


def _packed_conv_tower(kind: str, impl: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, patch_size=8)
    if kind == "videollama3":
        model = transformers.VideoLlama3VisionModel._from_config(transformers.VideoLlama3VisionConfig(**common),
                                                                 attn_implementation=impl)
    elif kind == "hunyuan-vl":
        from transformers.models.hunyuan_vl.modeling_hunyuan_vl import HunYuanVLVisionTransformer

        model = HunYuanVLVisionTransformer._from_config(transformers.HunYuanVLVisionConfig(**common),
                                                        attn_implementation=impl)
    elif kind == "hy-v4-vl":  # (in transformers 5.24, no probe named it: the same declarations as HunYuan-VL's)
        from transformers.models.hy_v4_vl.configuration_hy_v4_vl import HYV4VLVisionConfig
        from transformers.models.hy_v4_vl.modeling_hy_v4_vl import HYV4VLVisionModel

        model = HYV4VLVisionModel._from_config(HYV4VLVisionConfig(**common), attn_implementation=impl)
    else:
        model = transformers.PaddleOCRVisionModel._from_config(
            transformers.PaddleOCRVisionConfig(**common, image_size=32), attn_implementation=impl)
    return _sharpen_qk(model, ("q_proj.weight", "k_proj.weight"), 0.6)


@pytest.mark.parametrize("kind", ["videollama3", "hunyuan-vl", "hy-v4-vl", "paddleocr-vl"])
def test_packed_towers_with_a_convolution_over_stacked_patches_are_read_exact_against_eager(kind):
    """PaddleOCR-VL's ([1, N, C, p, p]), HunYuan-VL's ([N, C·p·p]) and VideoLLaMA3's vision towers declare a
    convolution of kernel = stride in ``embeddings`` and take ``grid_thw``, one attention call per image, tokens
    row-major: read as MoonViT's stack (they were refused as packed in a layout of their own)."""
    model = _packed_conv_tower(kind, "sdpa").eval()
    m = vl.LoadedModel.from_module(model, name=kind, device="cpu", data_config={"input_size": (3, 32, 48)})
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", (4, 6), 0)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(5))
    want = _stacked_reference(kind, lambda impl: _packed_conv_tower(kind, impl), x, 8)
    assert max(a.max().item() for a in want) > 0.5  # sharp: a wrong token order shows
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.forward(x)
    assert len(cap.maps) == len(want) == 2
    for got, ref in zip(cap.maps, want):
        assert got.shape == ref.shape == (2, 2, 24, 24)
        assert (got.double() - ref.double()).abs().max().item() < TOL
    plain = vl.LoadedModel.from_module(_packed_conv_tower(kind, "sdpa").eval(), name=kind, device="cpu")
    side = plain.spec.image_size[-1]  # without a size: its config's (it crashed on VideoLLaMA3's, HunYuan-VL's)
    with torch.no_grad(), vl.capture_attention(plain) as cap:
        plain.forward(torch.randn(1, 3, side, side))
    assert cap.maps[0].shape[-1] == plain.spec.grid[0] * plain.spec.grid[1] == (side // 8) ** 2
