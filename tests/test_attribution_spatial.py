"""Segmentation from the spatial decomposition as an attribution method (issue 65, item 4; Gandelsman et al. 2024,
Sec. 5.1): on the embedded pair each map is the patch tokens' direct contributions through every head to the target
logit, so the map, the prefix tokens' head parts and the other parts add up to the logit; the IoU of a map's
segmentation against a hand-computed case; the method in the faithfulness table with its IoU column."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.attribution import attribute, compare_methods
from vitlens.attribution.masks import segmentation_iou
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from test_text_targets import open_clip_named  # noqa: F401  (the fixture: a tiny open_clip CLIP)


@pytest.fixture(scope="module")
def scenes():
    return generate(6, seed=HELD_OUT_SEED)


@pytest.mark.parametrize("name", ["ref-vit", "ref-hybrid"])
def test_maps_are_the_heads_direct_contributions_to_the_target_logit(name, scenes) -> None:
    m = vl.load_model(name)
    x = vl.preprocess(list(scenes.images), m.data_config)
    target = [int(c) for c in scenes.labels]
    a = attribute(m, x, method="spatial_decomposition", target=target)
    assert a.maps.shape == (6, *m.spec.grid) and a.targets.tolist() == target
    with torch.no_grad():
        logits = m.forward(x).double().numpy()
    d = vl.decompose(m, x, target=target)
    rest = d.total() - d.heads[..., d.num_prefix_tokens:].sum((1, 2, 3))  # everything but the patch tokens' heads
    np.testing.assert_allclose(a.maps.sum((1, 2)) + rest, logits[np.arange(6), target], rtol=1e-5, atol=1e-5)
    other = attribute(m, x, method="spatial_decomposition", target=[(t + 1) % 4 for t in target])
    assert np.abs(other.maps - a.maps).max() > 1e-3  # class-specific


def test_spatial_decomposition_is_refused_and_not_offered_where_decompose_reads_no_residual_sum() -> None:
    import timm
    torch.manual_seed(0)
    beit = timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                             num_classes=3).eval()
    m = vl.LoadedModel.from_module(beit, name="beit-tiny", device="cpu")
    with pytest.raises(vl.UnsupportedModelError, match="spatial_decomposition"):
        attribute(m, torch.randn(1, 3, 32, 32), method="spatial_decomposition")
    from vitlens.attribution.methods import default_methods, methods_for
    # a default comparison (the report's, the app's choices) leaves it out there, and offers it where it reads
    assert "spatial_decomposition" not in methods_for(m) + default_methods(m)
    ref = vl.load_model("ref-vit")
    assert "spatial_decomposition" in methods_for(ref) and "spatial_decomposition" in default_methods(ref)
    from vitlens.attribution.methods import refusal
    line = refusal(m, "spatial_decomposition")  # the CLI's and the report's words: the model's own reason
    assert "vl.decompose" in line and "Beit" in line and "the methods defined for it" in line


def test_segmentation_iou_against_a_hand_count() -> None:
    maps = np.array([[[5.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])  # mean 2: only the top-left cell
    cover = np.array([[[1.0, 0.5], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]]])
    iou = segmentation_iou(maps, cover)
    assert iou[0] == pytest.approx(1.0 / 1.5)  # intersection 1 cell, union 1 + 1.5 - 1
    assert iou[1] == 0.0  # a flat map segments nothing


def test_the_table_scores_the_spatial_decomposition_with_its_iou(scenes) -> None:
    m = vl.load_model("ref-vit")
    table = compare_methods(m, list(scenes.images), methods=["spatial_decomposition", "rollout"], masks=scenes.masks,
                            labels=scenes.labels, metrics=("deletion_insertion",), steps=4)
    rows = {r["method"]: r for r in table.rows}
    assert set(rows) == {"spatial_decomposition", "rollout"}
    assert all(0.0 <= r["mask_iou"] <= 1.0 for r in rows.values())


def test_a_prompt_map_is_the_decomposition_of_the_cosine_similarity(open_clip_named) -> None:  # noqa: F811
    import open_clip
    import torch.nn.functional as F

    m, prompt = open_clip_named, "a photo of a dog"
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    a = attribute(m, x, method="spatial_decomposition", target=prompt)
    with torch.no_grad():
        text = F.normalize(m.model.encode_text(open_clip.get_tokenizer("vitlens-tiny-text")([prompt])), dim=-1)[0]
        image = m.model.encode_image(x)
    cosine = (F.normalize(image, dim=-1) @ text).double().numpy()
    d = vl.decompose(m.model.visual, x, direction=text.double().numpy())
    rest = (d.total() - d.heads[..., 1:].sum((1, 2, 3))) / image.norm(dim=-1).double().numpy()
    np.testing.assert_allclose(a.maps.sum((1, 2)) + rest, cosine, rtol=1e-4, atol=1e-6)
    assert a.target_kind == "text" and np.abs(a.maps).max() > 0
