"""What a new user tripped over, round five (issue 63), the library's side: attributions and their metrics on a
vision tower with no classifier head (63.1: the output's norm or a direction is the target, the metrics follow the
cosine similarity to the unperturbed output; no raw RuntimeError), a fine-tuned checkpoint's head size read from the
file (63.2), and a misspelt ``hf:`` folder said not to exist (63.3). Tiny random-init towers saved with
``save_pretrained`` into tmp folders."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.errors import InvalidParameterError, UnknownModelError

from test_cli import run_cli_here


@pytest.fixture(scope="module")
def siglip(tmp_path_factory) -> vl.LoadedModel:
    tr = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tower") / "siglip"
    torch.manual_seed(0)
    tr.SiglipVisionModel(tr.SiglipVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                               intermediate_size=64, image_size=32, patch_size=8)).save_pretrained(
        folder)
    return vl.load_model(f"hf:{folder}", device="cpu")


def features(m: vl.LoadedModel, x: torch.Tensor) -> torch.Tensor:
    """The tower's pooled output, read off the transformers model itself (not through vitlens)."""
    return m.model(pixel_values=x).pooler_output.float()


def test_a_towers_gradient_maps_explain_its_output_norm_by_hand(siglip):
    m, images = siglip, vl.sample_images()[:2]
    a = vl.attribute(m, images, "saliency")
    assert a.target_kind == "output" and a.target_name(0) == "the output's norm" and "output's norm" in a.note
    x = vl.preprocess(images, m.data_config).requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(features(m, x).norm(dim=-1).sum(), x)
    sy, sx = m.spec.stride_px
    want = g.abs().sum(1).reshape(2, 4, sy, 4, sx).sum((2, 4)).numpy()  # captum's |grad|, summed per token
    np.testing.assert_allclose(a.maps, want, rtol=1e-4, atol=1e-8)


def test_a_towers_maps_of_a_direction_explain_the_cosine_to_it(siglip):
    m, images = siglip, vl.sample_images()[:2]
    u = np.random.default_rng(0).normal(size=32)
    a = vl.attribute(m, images, "input_x_gradient", target=u)
    assert a.target_kind == "direction" and np.allclose(a.text_embeddings[0], u / np.linalg.norm(u), atol=1e-6)
    f = vl.deletion_insertion(m, images, a, steps=4)
    x = vl.preprocess(images, m.data_config)
    with torch.no_grad():
        cos = torch.nn.functional.normalize(features(m, x), dim=-1) @ torch.as_tensor(u / np.linalg.norm(u)).float()
    assert f.score == "cosine similarity to the direction"
    np.testing.assert_allclose(f.deletion[:, 0], cos.numpy(), rtol=1e-4)  # nothing removed: the clean image's score
    with pytest.raises(InvalidParameterError, match="no class 3 .*direction"):
        vl.attribute(m, images, "saliency", target=3)
    with pytest.raises(InvalidParameterError, match="output's size"):
        vl.attribute(m, images, "saliency", target=np.ones(7))


def test_a_towers_metrics_follow_the_cosine_to_the_unperturbed_output_never_a_raw_error(siglip):
    """Issue 63.1: deletion_insertion and compare_methods raised 'index -1 is out of bounds' on rollout's maps."""
    m, images = siglip, vl.sample_images()[:2]
    a = vl.attribute(m, images, "rollout")
    for f in (vl.deletion_insertion(m, images, a, steps=4),
              vl.deletion_insertion(m, images, a, protocol="petsiuk2018")):
        assert f.score == "cosine similarity to the unperturbed output"
        np.testing.assert_allclose(f.deletion[:, 0], 1.0, rtol=1e-5)  # the image itself: cosine 1
        assert np.all(np.abs(f.deletion) <= 1 + 1e-5) and np.all(np.abs(f.insertion) <= 1 + 1e-5)
    table = vl.compare_methods(m, images, ["rollout", "grad_rollout", "saliency"])
    assert [r["method"] for r in table.rows] == ["rollout", "grad_rollout", "saliency"]
    assert all(np.isfinite(r["deletion_auc"]) for r in table.rows)
    assert vl.perturbation_test(m, images, a).score == vl.road(m, images, a).score == \
        "cosine similarity to the unperturbed output"
    with pytest.raises(InvalidParameterError, match="no classes"):
        vl.perturbation_test(m, images, a, labels=[0, 1])  # accuracy needs a prediction: refused by name
    sanity = vl.sanity_table(m, images[:1], methods=["rollout", "saliency"])
    assert [r.method for r in sanity.results] == ["rollout", "saliency"]


def test_a_fine_tuned_checkpoints_head_size_comes_from_the_file(tmp_path):
    """Issue 63.2: a vit_tiny_patch16_224 with a 10-class head was refused for its architecture's 1000 classes."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tuned = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10)
    save_file({k: v.contiguous() for k, v in tuned.state_dict().items()}, tmp_path / "tuned.safetensors")
    m = vl.load_model(str(tmp_path / "tuned.safetensors"), arch="vit_tiny_patch16_224", device="cpu")
    assert m.spec.num_classes == 10 and torch.equal(m.model.head.weight, tuned.head.weight)


def test_a_misspelt_hf_folder_is_said_not_to_exist_and_the_cli_exits_2(siglip, tmp_path):
    """Issue 63.3: 'HFValidationError: Repo id must be in the form ...' in the app, 'unexpected error' and exit 1 in
    the CLI."""
    folder = siglip.spec.name[len("hf:"):]
    with pytest.raises(UnknownModelError, match=f"folder {folder}-tin does not exist.*Did you mean hf:{folder}\\?"):
        vl.load_model(f"hf:{folder}-tin", device="cpu")
    proc = run_cli_here("report", "--model", f"hf:{tmp_path}/nowhere/siglip", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "unexpected" not in proc.stderr, proc.stderr


def test_a_qwen2_vl_tower_saved_with_its_own_class_is_read(tmp_path):
    """Issue 63.5: a tower saved with transformers' own class was refused as 'not a transformers model class'; issue
    64 reads it (at 224 px, whole merge blocks: it has no size of its own; exact in tests/test_any_vit_round3.py)."""
    tr = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen

    cfg = tr.models.qwen2_vl.configuration_qwen2_vl.Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=8, spatial_merge_size=2,
        temporal_patch_size=2)
    qwen.Qwen2VisionTransformerPretrainedModel._from_config(cfg).save_pretrained(tmp_path / "qwen2vl")
    m = vl.load_model(f"hf:{tmp_path / 'qwen2vl'}", device="cpu")
    assert (m.spec.family, m.spec.image_size, m.spec.grid) == ("generic", (224, 224), (28, 28))
