"""What an attribution explains on a vision tower with no classifier head and no text tower (a SigLIP, Pixtral or
Qwen2.5-VL tower loaded as ``hf:FOLDER``, a DINOv2 backbone).

Such a tower has no class, so nothing has a class probability; what it does have is its output, a feature vector
(``LoadedModel.logits``: the pooled output, the class token or the mean token). So:

- a gradient method explains the output's norm (``target=None``), or the output's cosine similarity to a direction
  in the output space (``target=`` a vector of the output's size); the class-agnostic maps (rollout, Eigen-CAM) are
  what they are on any model and record that target only;
- the perturbation metrics (deletion / insertion, the perturbation test, ROAD) follow the cosine similarity of the
  perturbed image's output to the unperturbed image's own output (a class-free measure of how much of the
  representation the kept tokens hold), or to the direction for a direction's maps;
- accuracy against labels is not defined (there is no prediction to compare), and is refused by name.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from .text import has_text_tower

#: what a map of the output's norm explains (its ``label_names``' one entry)
OUTPUT_NORM = "the output's norm"
#: the metrics' score for a tower's maps without a direction
OWN_OUTPUT_SCORE = "cosine similarity to the unperturbed output"
#: the metrics' score (and the map's) for a direction's maps
DIRECTION_SCORE = "cosine similarity to the direction"


def is_headless(m: LoadedModel) -> bool:
    """A tower with neither a classifier head nor a text tower to score prompts with."""
    return m.spec.num_classes <= 0 and not has_text_tower(m)


def unit_outputs(m: LoadedModel, x: torch.Tensor) -> torch.Tensor:
    """[b, D] the tower's outputs for a batch, flattened and scaled to unit length (float32, no graph)."""
    return torch.nn.functional.normalize(m.logits(x).flatten(1), dim=-1)


class OutputTarget:
    """The target of maps on a headless tower: its output's norm, or a direction (one for all images).

    Attributes:
        direction: [D] the unit direction, or None for the norm.
        name: what is explained, in words (``label_names``' one entry).
        kind: the result's ``target_kind``: "output" (the norm) or "direction".
    """

    def __init__(self, m: LoadedModel, target: Any) -> None:
        self.direction: torch.Tensor | None = None
        if target is None:
            self.name, self.kind = OUTPUT_NORM, "output"
            return
        u = torch.as_tensor(np.asarray(target, dtype=np.float64))
        if u.ndim != 1 or u.numel() < 2 or not bool(torch.isfinite(u).all()) or float(u.norm()) == 0.0:
            raise InvalidParameterError(
                f"{m.spec.name} has no classifier head, so there is no class {target!r} to attribute; give "
                "target=None to explain the output's norm, or a direction: a non-zero vector of the output's size.")
        self.direction = (u / u.norm()).to(torch.float32)
        self.name, self.kind = "a direction", "direction"

    def batch(self, size: int, device: torch.device) -> torch.Tensor:
        """Each image's index into the scorer's one column (0)."""
        return torch.zeros(size, dtype=torch.long, device=device)

    def scorer(self, m: LoadedModel) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> [B, 1]: the output's norm, or its cosine similarity to the direction (graph kept for gradients)."""
        u = self.direction

        def score(inp: torch.Tensor) -> torch.Tensor:
            out = m.forward(inp).float().flatten(1)
            if u is None:
                return out.norm(dim=-1, keepdim=True)
            if out.shape[1] != u.numel():
                raise InvalidParameterError(f"the direction has {u.numel()} values and {m.spec.name}'s output "
                                            f"{out.shape[1]}; give a vector of the output's size.")
            return torch.nn.functional.normalize(out, dim=-1) @ u.to(out.device)[:, None]

        return score

    def embeddings(self) -> np.ndarray | None:
        """[1, D] the unit direction the metrics score against (``AttributionResult.text_embeddings``), or None."""
        return None if self.direction is None else self.direction[None].numpy()


def scores_own_output(m: LoadedModel, target_kind: str) -> bool:
    """Whether maps of ``target_kind`` on ``m`` are scored against each image's unperturbed output: the norm's maps,
    and class maps of a model without classes (files of an older vitlens, class-agnostic maps)."""
    return target_kind == "output" or (target_kind == "class" and m.spec.num_classes <= 0)


__all__ = ["DIRECTION_SCORE", "OUTPUT_NORM", "OWN_OUTPUT_SCORE", "OutputTarget", "is_headless", "scores_own_output",
           "unit_outputs"]
