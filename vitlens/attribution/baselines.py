"""What the faithfulness metrics score against: the image a removed token becomes (deletion/insertion's
baselines, also ROAD's and Chefer et al.'s fills) and a text target's prompt embeddings. Shared by
``faithfulness`` and ``perturbation``, below both, so neither imports the other for them."""
from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from .methods import AttributionResult
from .tower_targets import DIRECTION_SCORE, OWN_OUTPUT_SCORE, scores_own_output

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


def score_name(m: LoadedModel, attribution: AttributionResult) -> str:
    """What the metrics follow for ``attribution``'s maps on ``m``: the target class's probability, the cosine
    similarity to the prompt, or (a tower without classes: ``tower_targets``) to the direction or to the image's
    unperturbed output."""
    if attribution.target_kind == "text":
        return "cosine similarity to the prompt"
    if attribution.target_kind == "direction":
        return DIRECTION_SCORE
    return OWN_OUTPUT_SCORE if scores_own_output(m, attribution.target_kind) else "probability"


def prompt_embeddings(m: LoadedModel, attribution: AttributionResult) -> torch.Tensor | None:
    """The text embeddings a text target's maps are scored against (on the model's device), None for class
    maps; a clear error for maps that name a prompt but carry no embedding."""
    if attribution.target_kind not in ("text", "direction"):
        return None
    if attribution.text_embeddings is None:
        what = "prompt" if attribution.target_kind == "text" else "direction"
        raise InvalidParameterError(f"these {attribution.method} maps name a {what} but hold no embedding to score "
                                    "against; compute them with vl.attribute.")
    return torch.as_tensor(attribution.text_embeddings, device=m.device)


__all__ = ["BASELINES", "baseline_image", "prompt_embeddings", "score_name"]
