"""Deletion and insertion curves over patch tokens (Petsiuk et al. 2018), one of the perturbation metrics
of ``vitlens.attribution.metrics`` (``METRIC_TABLE["deletion_insertion"]``).

Deletion: replace the tokens' pixel blocks by a baseline in the order of the map (highest
first) and follow the target-class probability; a faithful map makes it fall fast (low area
under the curve). Insertion: start from the baseline image and put the blocks back in the same
order; a faithful map makes it rise fast (high area).

``protocol="petsiuk2018"`` runs Petsiuk et al. 2018's (RISE, section 4.1) own procedure instead: pixels
of the upsampled map, W a step, deletion to 0 in the normalised input, insertion from their blur
(``protocols``); ``ordering="absolute"`` ranks by |R|. The result records protocol and ordering.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..images import Images, iter_batches
from ..loading.model import LoadedModel
from ..results import Result, significant
from .baselines import baseline_image, prompt_embeddings, score_name
from .tower_targets import scores_own_output, unit_outputs
from .methods import AttributionResult
from ..words import counted
from .protocols import check_ordering, protocol as get_protocol
from .perturbation import removal_masks



@dataclass(eq=False, repr=False)
class FaithfulnessResult(Result):
    """Deletion/insertion curves of one method's maps.

    Attributes:
        method: the attribution method the maps came from.
        fractions: [S + 1] share of tokens removed (deletion) or inserted (insertion), 0 to 1.
        deletion: [B, S + 1] target-class probability as tokens are removed.
        insertion: [B, S + 1] target-class probability as tokens are inserted.
        deletion_auc, insertion_auc: [B] trapezoidal areas under the curves.
        baseline: "mean" (each channel's image mean) or "blur" (Gaussian blur of the image).
        model_name: the model's name.
        score: what the curves follow: "probability" (of the target class), or, for maps of a text
            target, "cosine similarity to the prompt" (the image-text similarity the maps explain); on a tower
            without classes (``tower_targets``) the cosine similarity to the direction or to the unperturbed output.
    """

    kind = "faithfulness"
    method: str
    fractions: np.ndarray
    deletion: np.ndarray
    insertion: np.ndarray
    deletion_auc: np.ndarray
    insertion_auc: np.ndarray
    baseline: str
    model_name: str = ""
    score: str = "probability"
    protocol: str = "vitlens"
    ordering: str = "signed"

    def summary(self) -> str:
        return (f"{self.model_name or 'model'}: {self.method} over {counted(len(self.deletion), 'image')}, "
                f"deletion AUC {significant(self.deletion_auc.mean())}, insertion AUC "
                f"{significant(self.insertion_auc.mean())} ({self.baseline} baseline), protocol {self.protocol}, "
                f"ordered by {'|R|' if self.ordering == 'absolute' else 'signed R'}")

    def to_rows(self) -> list[dict]:
        """One row per image: its deletion and insertion AUC."""
        return [{"method": self.method, "image": i, "deletion_auc": float(d), "insertion_auc": float(n),
                 "protocol": self.protocol, "ordering": self.ordering}
                for i, (d, n) in enumerate(zip(self.deletion_auc, self.insertion_auc))]


def _ranked(values: np.ndarray, ordering: str) -> np.ndarray:
    """The map's tokens, most relevant first (by R, or by |R| for the "absolute" ordering; ties in token order)."""
    values = np.asarray(values).reshape(-1)
    return np.argsort(-(np.abs(values) if ordering == "absolute" else values), kind="stable")


def _token_masks(order: np.ndarray, grid: tuple[int, int], stride: tuple[int, int], counts: Sequence[int],
                 size: tuple[int, int]) -> torch.Tensor:
    """[S + 1, H, W] masks, True where the first ``counts[s]`` tokens of ``order`` lie."""
    gh, gw = grid
    sy, sx = stride
    out = torch.zeros(len(counts), *size, dtype=torch.bool)
    for s, c in enumerate(counts):
        for tok in order[:c]:
            r, col = divmod(int(tok), gw)
            out[s, r * sy:(r + 1) * sy, col * sx:(col + 1) * sx] = True
    return out


def rise_blur(x: torch.Tensor, klen: int = 11, nsig: float = 5.0) -> torch.Tensor:
    """Petsiuk et al.'s insertion substrate: each channel convolved (zero padding ``klen // 2``) with their
    kernel, ``scipy.ndimage.gaussian_filter`` of a ``klen`` x ``klen`` delta with sigma ``nsig`` (its default
    reflect mode folds the tails back in, so the kernel sums to 1)."""
    from scipy.ndimage import gaussian_filter

    delta = np.zeros((klen, klen))
    delta[klen // 2, klen // 2] = 1.0
    k = torch.as_tensor(gaussian_filter(delta, nsig), dtype=x.dtype, device=x.device)
    c = x.shape[1]
    return torch.nn.functional.conv2d(x, k.expand(c, 1, klen, klen), padding=klen // 2, groups=c)


@torch.no_grad()
def _petsiuk(m: LoadedModel, images: Images, attribution: AttributionResult, ordering: str,
             batch_size: int) -> FaithfulnessResult:
    """RISE's CausalMetric (Petsiuk et al. 2018): W pixels a step over H steps of the upsampled map's pixel order,
    deletion to 0 (normalised), insertion from ``rise_blur``; score the target's probability (or prompt
    similarity); AUC the trapezoid over i / n_steps."""
    text, own = prompt_embeddings(m, attribution), scores_own_output(m, attribution.target_kind)
    dels, ins, offset, fractions = [], [], 0, np.zeros(1)
    for x in iter_batches(images, m.data_config, batch_size):
        x = x.to(m.device)
        h, w = x.shape[-2:]
        n_steps = (h * w + w - 1) // w
        counts = [min(w * i, h * w) for i in range(n_steps + 1)]
        fractions = np.arange(n_steps + 1, dtype=np.float64) / n_steps
        blurred = rise_blur(x)
        ref = unit_outputs(m, x) if own else None
        for i in range(x.shape[0]):
            j = offset + i
            masks = removal_masks(attribution.maps[j:j + 1], None, True, attribution.cell_px(m.spec.stride_px), (h, w),
                                  "pixel", ordering,
                                  counts=counts)[0].to(x.device)[:, None]  # [S, 1, H, W]
            deleted = torch.where(masks, torch.zeros_like(x[i:i + 1]), x[i:i + 1])
            inserted = torch.where(masks, x[i:i + 1], blurred[i:i + 1])
            both = torch.cat([deleted, inserted])
            out = torch.cat([m.logits(both[k:k + batch_size * 8]) for k in range(0, len(both), batch_size * 8)])
            if ref is not None:  # a tower without classes: how much of the image's own output survives
                probs = torch.nn.functional.normalize(out.flatten(1), dim=-1) @ ref[i]
            elif text is None:
                probs = out.softmax(-1)[:, int(attribution.targets[j])]
            else:
                probs = torch.nn.functional.normalize(out, dim=-1) @ text[int(attribution.targets[j])]
            scores = probs.cpu().numpy().astype(np.float64)
            dels.append(scores[: n_steps + 1])
            ins.append(scores[n_steps + 1:])
        offset += x.shape[0]
    deletion, insertion = np.stack(dels), np.stack(ins)
    return FaithfulnessResult(method=attribution.method, fractions=fractions, deletion=deletion, insertion=insertion,
                              deletion_auc=np.asarray(np.trapezoid(deletion, fractions, axis=1)),
                              insertion_auc=np.asarray(np.trapezoid(insertion, fractions, axis=1)),
                              baseline="zero/blur", model_name=m.spec.name, score=score_name(m, attribution),
                              protocol="petsiuk2018", ordering=ordering)


@torch.no_grad()
def deletion_insertion(m: LoadedModel, images: Images, attribution: AttributionResult, steps: int = 16,
                       baseline: str = "mean", batch_size: int = 16, protocol: str = "vitlens",
                       ordering: str | None = None) -> FaithfulnessResult:
    """Deletion and insertion curves of ``attribution``'s maps on the same images and targets.

    Deletion replaces the tokens the map ranks highest first by the baseline and follows the target's
    probability (lower area is more faithful); insertion starts from the baseline image and puts the
    highest-ranked tokens back first (higher area is more faithful).

    Args:
        m: the model the maps explain.
        images: the images the maps were made on.
        attribution: the maps (and their targets: a class, or a prompt for a text tower).
        steps: curve points beyond the first (the share of tokens changed goes 0, 1/steps, .., 1).
        baseline: what removed tokens become: "mean" (the image's mean colour) or "blur".
        batch_size: images per step.
        protocol: "vitlens" (tokens, ``steps`` steps, one ``baseline``) or "petsiuk2018" (RISE's own procedure,
            ``protocols``; ``steps`` and ``baseline`` are then theirs).
        ordering: "signed" (rank by R) or "absolute" (by |R|); None for the protocol's ("signed").

    Returns:
        A ``FaithfulnessResult``: ``deletion`` and ``insertion`` [B, steps + 1] curves (probabilities, or
            cosine similarities for a prompt), their AUCs [B] over the fractions in [0, 1].

    Raises:
        InvalidParameterError: ``steps`` < 1 or an unknown baseline.
    """
    ordering = check_ordering(get_protocol("deletion_insertion", protocol).ordering if ordering is None else ordering)
    if protocol == "petsiuk2018":
        return _petsiuk(m, images, attribution, ordering, batch_size)
    if steps < 1:
        raise InvalidParameterError(f"steps must be >= 1; got {steps}.")
    text, own = prompt_embeddings(m, attribution), scores_own_output(m, attribution.target_kind)
    grid, cell = attribution.grid, attribution.cell_px(m.spec.stride_px)  # a stage's cells for a Swin's CAM
    n_tok = grid[0] * grid[1]
    counts = [round(n_tok * s / steps) for s in range(steps + 1)]
    fractions = np.asarray(counts, dtype=np.float64) / n_tok
    dels, ins, offset = [], [], 0
    s = steps + 1
    for x in iter_batches(images, m.data_config, batch_size):
        x = x.to(m.device)
        b = x.shape[0]
        base = baseline_image(x, baseline)
        masks = torch.stack([_token_masks(_ranked(attribution.maps[offset + i], ordering), grid, cell, counts,
                                          (int(x.shape[-2]), int(x.shape[-1])))
                             for i in range(b)]).to(x.device)[:, :, None]
        # every image of the batch at every step: [b, 2, S, C, H, W] (deleted, inserted), through the model in
        # forwards of batch_size x 2 S images (a few forwards per removal step for the batch, not one per image)
        both = torch.stack([torch.where(masks, base[:, None], x[:, None]),
                            torch.where(masks, x[:, None], base[:, None])], dim=1).reshape(b * 2 * s, *x.shape[1:])
        chunk = batch_size * 2 * s
        out = torch.cat([m.logits(both[k:k + chunk]) for k in range(0, len(both), chunk)]).reshape(b, 2 * s, -1)
        targets = torch.as_tensor(np.asarray(attribution.targets[offset:offset + b], dtype=np.int64), device=out.device)
        if own:  # a tower without classes: the cosine similarity to the image's unperturbed output
            probs = (torch.nn.functional.normalize(out, dim=-1) * unit_outputs(m, x)[:, None, :]).sum(-1)
        elif text is None:
            probs = out.softmax(-1).gather(2, targets[:, None, None].expand(b, 2 * s, 1))[..., 0]
        else:  # the cosine similarity to the image's prompt, the score the maps explain
            probs = (torch.nn.functional.normalize(out, dim=-1) * text[targets][:, None, :]).sum(-1)
        scores = probs.cpu().numpy().astype(np.float64)
        dels += list(scores[:, :s])
        ins += list(scores[:, s:])
        offset += b
    deletion, insertion = np.stack(dels), np.stack(ins)
    return FaithfulnessResult(method=attribution.method, fractions=fractions, deletion=deletion, insertion=insertion,
                              deletion_auc=np.trapezoid(deletion, fractions, axis=1),
                              insertion_auc=np.trapezoid(insertion, fractions, axis=1), baseline=baseline,
                              model_name=m.spec.name, score=score_name(m, attribution), ordering=ordering)
