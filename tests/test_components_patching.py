"""Activation patching (issue 51; docs/definitions.md, "Activation patching"): each batched patch equals a patch
done by hand with plain hooks, one forward per patch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitlens as vl
from vitlens.components import PatchingResult

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)


@pytest.fixture(scope="module")
def setup() -> tuple[VisionTransformer, torch.Tensor, torch.Tensor, PatchingResult]:
    torch.manual_seed(0)
    m = VisionTransformer(**SMALL, init_values=0.5).double().eval()
    clean = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    corrupted = clean + 2 * torch.randn_like(clean)
    return m, clean, corrupted, vl.patch_activations(m, clean, corrupted, target=1, batch_size=7)


def by_hand(m: VisionTransformer, clean: torch.Tensor, corrupted: torch.Tensor, module: torch.nn.Module,
            pre: bool, edit) -> float:  # noqa: ANN001 - edit(clean_value, corrupted_value) -> patched value
    """Record ``module``'s output (or input) on the clean image, put it into the corrupted run through ``edit``."""
    kept = {}
    if pre:
        h = module.register_forward_pre_hook(lambda mod, args: kept.__setitem__("v", args[0]))
    else:
        h = module.register_forward_hook(lambda mod, args, out: kept.__setitem__("v", out))
    with torch.no_grad():
        m(clean)
    h.remove()
    if pre:
        h = module.register_forward_pre_hook(lambda mod, args: (edit(kept["v"], args[0]),))
    else:
        h = module.register_forward_hook(lambda mod, args, out: edit(kept["v"], out))
    with torch.no_grad():
        out = float(m(corrupted)[0, 1])
    h.remove()
    return out


def test_batched_patches_equal_patches_by_hand(setup) -> None:  # noqa: ANN001
    m, clean, corrupted, r = setup
    with torch.no_grad():
        assert r.clean == float(m(clean)[0, 1]) and r.corrupted == float(m(corrupted)[0, 1])
    whole = lambda c, k: c  # noqa: E731

    def one_head(h: int):  # noqa: ANN202
        def edit(c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            k = k.clone()
            k[..., h * 8:(h + 1) * 8] = c[..., h * 8:(h + 1) * 8]
            return k
        return edit

    def one_token(q: int):  # noqa: ANN202
        def edit(c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            k = k.clone()
            k[:, q] = c[:, q]
            return k
        return edit

    for l in range(2):
        blk = m.blocks[l]
        assert r.attn[l] == pytest.approx(by_hand(m, clean, corrupted, blk.ls1, False, whole), rel=1e-12)
        assert r.mlp[l] == pytest.approx(by_hand(m, clean, corrupted, blk.ls2, False, whole), rel=1e-12)
        for h in (3,):
            assert r.heads[l, h] == pytest.approx(by_hand(m, clean, corrupted, blk.attn.proj, True, one_head(h)),
                                                  rel=1e-12)
        for q in (5,):
            assert r.resid[l, q] == pytest.approx(by_hand(m, clean, corrupted, blk, False, one_token(q)), rel=1e-12)
    assert r.resid[-1, 0] == pytest.approx(r.clean, rel=1e-12)  # the class token's last residual is the answer
    assert r.restored(np.float64(r.clean)) == pytest.approx(1.0)


def test_patching_result_rows_and_sizes(setup) -> None:  # noqa: ANN001
    m, clean, corrupted, r = setup
    assert r.heads.shape == (2, 4) and r.resid.shape == (2, 17)
    assert r.forwards == 2 + -(-2 * (2 + 4 + 17) // 7)
    assert len(r.to_rows()) == 2 * (2 + 4 + 17) and "restores" in r.summary()
    with pytest.raises(vl.InvalidParameterError, match="one image"):
        vl.patch_activations(m, torch.cat([clean, clean]), torch.cat([corrupted, corrupted]))


def test_patching_figure(setup) -> None:  # noqa: ANN001
    from vitlens import figures

    r = setup[3]
    np.testing.assert_allclose(np.asarray(figures.figure_for(r).data[0].z), r.restored(r.heads))
