"""The logit lens on every model the component analyses read (``layout``; docs/definitions.md, "Logit lens"): each
depth's residual (``blocks.{i}.hook_resid_post``) read through the model's own final norm, pooling and head (a tower
without classes: its projection, scored against prompt embeddings)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..results import Result
from .layout import Layout, prompts, residual_stream
from .arguments import per_image
from .stream import module_of, pixels_for
from ..words import class_label, class_names_of


@dataclass(eq=False, repr=False)
class LogitLensResult(Result):
    """What each depth's residual already predicts.

    Attributes:
        target: [B] the class followed.
        pooled: [B, L + 1] the target's logit when depth d's residual goes through the final norm and the model's
            own head (its pooling included); depth 0 is the embeddings, depth L the output.
        tokens: [B, L + 1, N] the target's logit when one token's residual goes through the final norm, the head's
            norm and the head alone (no pooling).
        top_classes: [B, L + 1, k] the pooled reading's top classes by depth.
        top_logits: [B, L + 1, k] their logits.
        output: [B] the model's logit for the target.
        num_prefix_tokens: prefix tokens before the patches.
        model_name: the model's name.
        label_names: the model's class names ([] where unknown): what the summary and figures call the classes.
    """

    kind = "logit_lens"
    target: np.ndarray
    pooled: np.ndarray
    tokens: np.ndarray
    top_classes: np.ndarray
    top_logits: np.ndarray
    output: np.ndarray
    num_prefix_tokens: int
    model_name: str = ""
    label_names: list = field(default_factory=list)

    def target_name(self, b: int) -> str:
        """Image ``b``'s target class in words ("ring", or "class 4" without names)."""
        return class_label(self.label_names, int(self.target[b]))

    def summary(self) -> str:
        said = []
        for b in range(len(self.target)):  # every image, not the first alone
            on_top = self.top_classes[b, :, 0] == self.target[b]
            depth = f"first on top at depth {int(np.argmax(on_top))}" if on_top.any() else "never on top"
            said.append(f"{self.target_name(b)} {depth}" + (f" (image {b})" if len(self.target) > 1 else ""))
        return (f"{self.model_name or 'model'}: logit lens over {self.pooled.shape[1] - 1} blocks; {'; '.join(said)}; "
                f"last depth = output (|diff| {np.abs(self.pooled[:, -1] - self.output).max():.1e})")

    def to_rows(self) -> list[dict]:
        """One row per (image, depth): the target's pooled logit and the top class."""
        return [{"image": b, "depth": d, "target": int(self.target[b]), "logit": float(self.pooled[b, d]),
                 "top_class": int(self.top_classes[b, d, 0]), "top_logit": float(self.top_logits[b, d, 0])}
                for b in range(self.pooled.shape[0]) for d in range(self.pooled.shape[1])]


def logit_lens(model: object, pixels: object, target: int | Sequence[int] | None = None,
               top_k: int = 5, direction: object = None) -> LogitLensResult:
    """Each depth's residual read through the model's own final norm and head (docs/definitions.md, "Logit lens").

    Args:
        model: a ``LoadedModel`` or a module that ``vl.decompose`` reads (``layout.READ``).
        pixels: [B, 3, H, W] preprocessed images (with a LoadedModel, anything ``vl.preprocess`` reads).
        target: the class followed (one, or one per image); default each image's prediction.
        top_k: classes listed per depth.
        direction: for a model without classes (a CLIP, SigLIP or OpenCLIP vision tower, ``ViTModel``,
            ``Dinov2Model``): a [F] text embedding or chosen direction, or a [K, F] matrix of prompt embeddings (then
            ``target`` and the top classes index the prompts).

    Returns:
        A ``LogitLensResult``; its last depth equals the output.
    """
    module, name = module_of(model, "logit_lens")
    layout = Layout(module, name)
    x = pixels_for(model, module, pixels)
    if not layout.classes:
        return _tower_lens(layout, name, x, target, top_k, direction)
    if direction is not None:
        raise InvalidParameterError("direction= is for models without classes (CLIP, SigLIP, OpenCLIP towers, "
                                    "ViTModel, Dinov2Model); a classifier follows a class (target=).")
    stream, logits, _ = residual_stream(layout, x)
    b, n_classes = logits.shape
    labels = (logits.argmax(-1) if target is None else per_image(target, "target", n_classes, b)).to(logits.device)

    def read(x_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layout.features(x_d).double(), layout.token_features(x_d).double()
    result = _lens(stream, read, labels, logits.double(), top_k, layout.num_prefix, name)
    result.label_names = class_names_of(model)  # what the summary and the figure call the classes
    return result


def _lens(stream: list[torch.Tensor], read: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
          labels: torch.Tensor, output: torch.Tensor, top_k: int, num_prefix: int, name: str) -> LogitLensResult:
    """Each depth read by ``read`` (pooled [B, C] and per token [B, N, C] scores), the target followed."""
    k = max(1, min(int(top_k), output.shape[-1]))
    pooled, tokens, top_c, top_v = [], [], [], []
    with torch.no_grad():
        for x_d in stream:
            scores, per_token = read(x_d)
            pooled.append(scores.gather(1, labels[:, None])[:, 0])
            tokens.append(per_token.gather(2, labels[:, None, None].expand(-1, per_token.shape[1], 1))[..., 0])
            v, c = scores.topk(k, dim=-1)
            top_c.append(c)
            top_v.append(v)
    return LogitLensResult(
        target=labels.cpu().numpy(), pooled=torch.stack(pooled, 1).cpu().numpy(),
        tokens=torch.stack(tokens, 1).cpu().numpy(), top_classes=torch.stack(top_c, 1).cpu().numpy(),
        top_logits=torch.stack(top_v, 1).cpu().numpy(),
        output=output.gather(1, labels[:, None])[:, 0].cpu().numpy(), num_prefix_tokens=num_prefix, model_name=name)


def _tower_lens(tower: Layout, name: str, x: torch.Tensor, target: int | Sequence[int] | None, top_k: int,
                direction: object) -> LogitLensResult:
    """A model without classes: each depth through its final norm, pooling and projection, scored against the prompt
    embeddings (``u . embedding``; K = 1 for one direction)."""
    stream, out, _ = residual_stream(tower, x)
    t = prompts(direction, out.shape[-1], out)
    output = out.double() @ t.T
    b = output.shape[0]
    labels = (output.argmax(-1) if target is None else
              per_image(target, "target (a prompt)", t.shape[0], b)).to(output.device)

    def read(x_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tower.features(x_d).double() @ t.T, tower.token_features(x_d).double() @ t.T
    return _lens(stream, read, labels, output, top_k, tower.num_prefix, name)
