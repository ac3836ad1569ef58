"""The component analyses' arguments checked at the boundary (issue 62, items 15 and 16): an empty reference set, images
of another size or with NaN, indices that are text, NaN or fractions, and target lists of the wrong length are refused
in one line naming the argument, before any forward, never as a raw AssertionError / ValueError / RuntimeError or as
NaN logits reported as a result."""
from __future__ import annotations

import math

import pytest
import timm
import torch

import vitlens as vl


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=5).eval()
    return vl.LoadedModel.from_module(model, name="small")


@pytest.fixture(scope="module")
def x():
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32)


def refused(match: str, call) -> None:
    with pytest.raises(vl.InvalidParameterError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_mean_ablation_over_no_reference_image_is_refused_not_reported_as_nan(small, x):
    refused("reference holds no image", lambda: vl.mean_ablate(small, x, [("head", 0, 0)], reference=x[:0]))
    refused("pixels holds no image", lambda: vl.mean_ablate(small, x[:0], [("mlp", 1)]))


@pytest.mark.parametrize("bad, what", [("a", "layer"), (math.nan, "layer"), (0.5, "layer"), (True, "layer")])
def test_a_component_index_that_is_no_whole_number_is_named(small, x, bad, what):
    refused(f"component .*'s {what} must be a whole number", lambda: vl.mean_ablate(small, x, [("head", bad, 0)]))


def test_component_lists_and_labels_of_the_wrong_form_are_named(small, x):
    refused("components must be a list", lambda: vl.mean_ablate(small, x, "head 0 0"))
    refused("component 'mlp'", lambda: vl.mean_ablate(small, x, ["mlp"]))
    refused("labels must be one class per image \\(2", lambda: vl.mean_ablate(small, x, [("mlp", 0)], labels=[1]))
    refused("labels\\[1\\] must be a whole number", lambda: vl.mean_ablate(small, x, [("mlp", 0)], labels=[1, "b"]))


@pytest.mark.parametrize("target, match", [("cat", "target \\(a class\\) must be a whole number"),
                                           (math.nan, "must be a whole number"), (2.5, "must be a whole number"),
                                           (7, "must be an index in \\[0, 5\\)")])
def test_patching_names_a_target_that_is_no_class_index(small, x, target, match):
    refused(match, lambda: vl.patch_activations(small, x[:1], x[1:], target=target))


def test_patching_refuses_images_of_another_size_or_with_nan_before_any_forward(small, x):
    other = torch.randn(1, 3, 16, 16)
    refused("clean is 16x16 px, but the model runs at 32x32 px only", lambda: vl.patch_activations(small, other, other))
    nan = x[1:].clone()
    nan[0, 0, 0, 0] = math.nan
    refused("corrupted holds NaN or infinite values", lambda: vl.patch_activations(small, x[:1], nan))
    refused("batch_size must be a whole number", lambda: vl.patch_activations(small, x[:1], x[1:], batch_size="8"))


def test_a_target_list_of_the_wrong_length_is_named_by_the_decomposition_and_the_lens(small, x):
    refused("target must be one index for every image or one per image \\(2\\); got 3",
            lambda: vl.decompose(small, x, target=[0, 1, 2]))
    refused("target must be one index for every image or one per image \\(2\\); got 3",
            lambda: vl.logit_lens(small, x, target=[0, 1, 2]))
    refused("target\\[1\\] must be a whole number", lambda: vl.logit_lens(small, x, target=[0, "one"]))
    # what is right still runs: one target for both images, or one each
    assert vl.decompose(small, x, target=3).target.tolist() == [3, 3]
    assert vl.logit_lens(small, x, target=[1, 4]).target.tolist() == [1, 4]
