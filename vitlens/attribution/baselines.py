"""What the faithfulness metrics score against: the image a removed token becomes (deletion/insertion's
baselines, also ROAD's and Chefer et al.'s fills) and a text target's prompt embeddings. Shared by
``faithfulness`` and ``perturbation``, below both, so neither imports the other for them."""
from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from .methods import AttributionResult

BASELINES = ("mean", "blur")


def baseline_image(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What a removed token is replaced by, for a batch [B, C, H, W]."""
    if kind == "mean":
        return x.mean(dim=(2, 3), keepdim=True).expand_as(x).clone()
    if kind == "blur":
        from torchvision.transforms.functional import gaussian_blur

        k = max(3, (min(x.shape[-2:]) // 8) | 1)
        return gaussian_blur(x, kernel_size=[k, k], sigma=[k / 3.0, k / 3.0])
    raise InvalidParameterError(f"baseline must be one of {', '.join(BASELINES)}; got {kind!r}.")


def prompt_embeddings(m: LoadedModel, attribution: AttributionResult) -> torch.Tensor | None:
    """The text embeddings a text target's maps are scored against (on the model's device), None for class
    maps; a clear error for maps that name a prompt but carry no embedding."""
    if attribution.target_kind != "text":
        return None
    if attribution.text_embeddings is None:
        raise InvalidParameterError(f"these {attribution.method} maps name a prompt but hold no text embedding "
                                    "to score against; compute them with vl.attribute.")
    return torch.as_tensor(attribution.text_embeddings, device=m.device)


__all__ = ["BASELINES", "baseline_image", "prompt_embeddings"]
