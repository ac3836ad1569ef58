"""The Grad-CAM family for any ViT vitlens reads, through ``pytorch_grad_cam`` (grad-cam 1.5.7).

A CAM weights the channels of one layer's activations [B, C, gh, gw] and sums them; for a ViT the
"feature map" is the patch tokens of a block, put back on the token grid. That reshape is the
question asked most in grad-cam's issues (#76, #509), and it is derived here from the model's spec:

- every prefix token (class, distillation, registers: ``spec.num_prefix_tokens``) is dropped, the
  rest are the patch tokens in row-major order on the grid of the actual input (``m.grid_for``,
  non-square and other input sizes included); token layout [B, T, C] in every family vitlens
  reads (timm, Hugging Face, torchvision and open_clip blocks are batch-first);
- a layer that outputs a feature map [B, C, gh, gw] already (a hybrid's CNN stage named by
  ``target_layer``, at the token grid) is taken as it is;
- on a hierarchical model (Swin, SAM / ViTDet: a kind of stages, ``Kind.stages``) the default layer is the one
  the family names (``Family.cam_layer``: the last stage's last block, whose output the final norm and the pool
  hand the classifier), and its output is put on the grid of the stage it has: [B, H, W, C] (timm's stages,
  NHWC), [B, H * W, C] (Hugging Face's) or [B, C, H, W], for (H, W) one of the stages' grids
  (``stage_layouts``). The CAM is then on that stage's grid (the last stage's: 32 px cells on a 224 px Swin,
  coarser than the first stage's 4 px patch grid), which the result states (``AttributionResult.grid`` and
  ``stride_px``).

The maps stay on the token grid: the package would min-max scale and resize each CAM to the input
size, so the package's CAM classes are driven here one step lower: its hooks record the layer's
activations and gradients of one forward and one backward for the whole batch, and each
method's own ``get_cam_image`` gives the [B, gh, gw] CAM, ReLU'd as the package does and not
rescaled (values are comparable across images). ScoreCAM's channel scores are computed by
``_score_cam_weights`` (the package's formula, masked images of all images batched together in
chunks: the package's loop over images would hold B x C masked copies of the batch at once).

Methods: ``gradcam``, ``gradcam++``, ``xgradcam``, ``hirescam``, ``layercam``, ``eigencam``,
``eigengradcam``, ``scorecam``. Left out: AblationCAM (one forward per channel and image, as
ScoreCAM, but needs a model-specific ablation layer), FullGrad (needs every bias's gradient, not a
token layer) and the KPCA/finer/Shapley variants (kernel PCA or Hessian products, slow).
"""
from __future__ import annotations

import difflib
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.spec import ModelSpec
from ..errors import InvalidParameterError, ViewNotAvailableError
from ..kinds import kind_of
from ..loading.model import LoadedModel

#: vitlens method name -> pytorch_grad_cam class name
CAM_CLASSES: dict[str, str] = {
    "gradcam": "GradCAM", "gradcam++": "GradCAMPlusPlus", "xgradcam": "XGradCAM", "hirescam": "HiResCAM",
    "layercam": "LayerCAM", "eigencam": "EigenCAM", "eigengradcam": "EigenGradCAM", "scorecam": "ScoreCAM",
}

#: the import name of the package the CAMs need (grad-cam)
CAM_PACKAGE = "pytorch_grad_cam"

CAM_INSTALL = {"python": "Install it with: pip install 'vitlens[cam]' (or pip install grad-cam; it pulls "
                         "opencv-python, about 72 MB, and ttach).",
               "cli": "Install it with: pip install 'vitlens[cam]'.",
               "app": "Install it in the app's environment: pip install 'vitlens[cam]'."}

#: the pre-attention norm of a block, by family: timm (ViT, DeiT, EVA, BEiT), Hugging Face ViT/DeiT/Dinov2,
#: Hugging Face CLIP/SigLIP, torchvision and open_clip, timm's parallel blocks (one norm before attention and MLP)
def grad_cam_package() -> Any:
    """``pytorch_grad_cam``, imported; a missing one is a ViewNotAvailableError saying how to install it."""
    try:
        return __import__("pytorch_grad_cam")
    except ImportError as e:
        raise ViewNotAvailableError("The Grad-CAM methods need the grad-cam package (pytorch_grad_cam), which is not "
                                    "installed.", fixes=CAM_INSTALL) from e


def cam_package_available() -> bool:
    """Whether grad-cam is installed (without importing it, which pulls opencv)."""
    import importlib.util

    return importlib.util.find_spec(CAM_PACKAGE) is not None


def default_target_layer(m: LoadedModel) -> str:
    """The module name CAMs read by default: the pre-attention norm of the last block (``blocks.11.norm1``).

    Why there (grad-cam's FAQ for ViTs says the same): the classifier reads the class token (or the
    pool) after the last block, and the patch tokens reach it only through the last block's attention,
    so the patch tokens of the last block's *output* get no gradient at all in a class-token model;
    the input of the last attention is the latest place where every patch token still carries both
    its content and a gradient. The norm's output is what the attention actually reads.

    The family names that norm (``Family.attention_input``: ``norm1`` for timm, ``layernorm_before`` /
    ``layer_norm1`` for Hugging Face, ``ln_1`` for torchvision and OpenCLIP).

    Raises:
        ViewNotAvailableError: the family does not name it for this block; name a layer with ``target_layer``.
    """
    last = m.block_names()[-1]
    block = m.blocks()[-1]
    child = m.family.attention_input(m.model, block)  # the family says which child its attention reads
    if child is not None:
        return f"{last}.{child}"
    children = ", ".join(n for n, _ in block.named_children())
    raise ViewNotAvailableError(f"vitlens does not know which layer of {type(block).__name__} ({last}: {children}) is "
                                "the input of its attention; name one with target_layer='...' (a module that "
                                "outputs the tokens [B, T, C]).")


def stage_layouts(m: LoadedModel) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(token grid, pixel stride) of every stage of a hierarchical model at its built size (``Family.stage_layout``:
    Swin's), or of its one grid (SAM / ViTDet, a ViT)."""
    layout = m.family.stage_layout  # an optional ability: None where the family has one grid
    if layout is None:
        # the ignore below: spec's grid and stride are pairs; tuple() loses their length
        return [(tuple(m.spec.grid), tuple(m.spec.stride_px))]  # type: ignore[list-item]
    # the ignore below: 2 ints (mypy: tuple[int, ...])
    return [(tuple(int(v) for v in g), tuple(int(v) for v in s)) for g, s in layout(m.model)]  # type: ignore[misc]


def default_cam_layer(m: LoadedModel) -> str:
    """The layer CAMs read by default: for a hierarchical model the family's ``cam_layer`` (the last stage's last
    block's output), else ``default_target_layer`` (the last block's pre-attention norm)."""
    if kind_of(m).stages:
        name = m.family.cam_layer(m.model)
        if name is None:
            raise ViewNotAvailableError(f"vitlens does not know which layer of {m.spec.name} holds its last stage's "
                                        "tokens; name one with target_layer='...'.")
        return name
    return default_target_layer(m)


def resolve_target_layer(m: LoadedModel, name: str) -> nn.Module:
    """The module called ``name`` in ``m.model.named_modules()``; a wrong name lists the nearest names."""
    modules = dict(m.model.named_modules())
    if not isinstance(name, str) or name not in modules:
        near = difflib.get_close_matches(str(name), list(modules), n=6, cutoff=0.5)
        hint = (f"nearest names: {', '.join(near)}" if near
                else f"the blocks are {m.block_names()[0]} ... {m.block_names()[-1]}")
        raise InvalidParameterError(f"target_layer must name a module of {m.spec.name} (model.named_modules()); "
                                    f"got {name!r}; {hint}.")
    return modules[name]


def token_reshape(spec: ModelSpec, grid: tuple[int, int], batch: int, layer: str) -> Callable[[Any], torch.Tensor]:
    """The reshape transform for grad-cam: tokens [B, T, C] -> patch tokens on the grid [B, C, gh, gw], float32.

    The prefix tokens (``spec.num_prefix_tokens``: class, distillation, registers) come first in every family
    vitlens reads and are dropped; a feature map [B, C, gh, gw] at the grid passes through.
    """
    gh, gw = grid
    tokens = spec.num_tokens(grid)

    def reshape(out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise InvalidParameterError(f"target_layer {layer!r} outputs a {type(out).__name__}, not a tensor of "
                                        "tokens; name a module inside that block that outputs [B, T, C] (e.g. its "
                                        "norm).")
        if out.ndim == 4 and tuple(out.shape[-2:]) == (gh, gw) and out.shape[0] == batch:
            return out.float()
        if out.ndim != 3 or out.shape[0] != batch or out.shape[1] != tokens:
            raise InvalidParameterError(
                f"target_layer {layer!r} outputs {tuple(out.shape)}, not the tokens [B={batch}, T={tokens}, C] "
                f"({spec.num_prefix_tokens} prefix + {gh}x{gw} patch tokens) nor a [B, C, {gh}, {gw}] feature map; "
                "name a module that does.")
        patches = out[:, spec.num_prefix_tokens:].float()
        return patches.reshape(batch, gh, gw, out.shape[-1]).permute(0, 3, 1, 2)

    return reshape


def stage_reshape(grids: list[tuple[int, int]], batch: int, layer: str) -> Callable[[Any], torch.Tensor]:
    """The reshape transform for grad-cam on a hierarchical model: a stage's tokens -> [B, C, H, W], float32.

    The layer's output is [B, H, W, C] (timm's Swin stages and SAM's blocks are NHWC), [B, H * W, C] (Hugging
    Face's Swins, row-major) or [B, C, H, W], with (H, W) one of ``grids`` (the stages' token grids); NHWC is
    tried first (every family vitlens reads this way hands its stages NHWC or [B, N, C])."""
    def reshape(out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise InvalidParameterError(f"target_layer {layer!r} outputs a {type(out).__name__}, not a tensor of a "
                                        "stage's tokens; name a module that outputs one (e.g. a stage's last block).")
        if out.shape[0] == batch and out.ndim == 4:
            if tuple(out.shape[1:3]) in grids:
                return out.float().permute(0, 3, 1, 2)
            if tuple(out.shape[2:4]) in grids:
                return out.float()
        if out.shape[0] == batch and out.ndim == 3:
            for gh, gw in grids:
                if out.shape[1] == gh * gw:
                    return out.float().reshape(batch, gh, gw, out.shape[-1]).permute(0, 3, 1, 2)
        raise InvalidParameterError(
            f"target_layer {layer!r} outputs {tuple(out.shape)}, not a stage's tokens [B={batch}, H, W, C], "
            f"[B, H * W, C] or [B, C, H, W] on one of the stage grids {', '.join(f'{h}x{w}' for h, w in grids)}; "
            "name a module that does.")

    return reshape


class _Scored(nn.Module):
    """The model as grad-cam calls it: ``self.model(x)`` -> the scores the targets index (class logits, or
    similarities to prompts for a text target)."""

    def __init__(self, model: nn.Module, score: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = model
        self._score = score

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._score(x)


@torch.no_grad()
def _score_cam_weights(score: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, acts: np.ndarray,
                       t: torch.Tensor, chunk: int) -> np.ndarray:
    """ScoreCAM's channel weights (Wang et al. 2020; pytorch_grad_cam's ``ScoreCAM.get_cam_weights``): each
    channel map upsampled bilinearly (align_corners, as ``UpsamplingBilinear2d``) to the input, min-max scaled,
    multiplied into the image; the weights are the softmax over channels of the target's scores on those
    images. Masked images of every image are scored ``chunk`` at a time."""
    a = torch.from_numpy(acts).to(x.device, torch.float32)
    b, c = a.shape[:2]
    # bilinear interpolation with align_corners hits the grid values at the corners and only mixes them, so
    # the upsampled map's min and max are the grid's
    lo, hi = a.flatten(2).min(-1).values, a.flatten(2).max(-1).values
    scores = torch.empty(b * c, device=x.device)
    for start in range(0, b * c, chunk):
        idx = torch.arange(start, min(start + chunk, b * c), device=x.device)
        img, ch = idx // c, idx % c
        up = F.interpolate(a[img, ch][:, None], size=x.shape[-2:], mode="bilinear", align_corners=True)
        up = (up - lo[img, ch][:, None, None, None]) / (hi - lo)[img, ch][:, None, None, None].add(1e-8)
        out = score(x[img] * up).float()
        scores[start: start + len(idx)] = out[torch.arange(len(idx), device=x.device), t[img]]
    return scores.reshape(b, c).softmax(-1).cpu().numpy()


def cam_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int], params: dict[str, Any],
             score: Callable[[torch.Tensor], torch.Tensor], method: str) -> tuple[np.ndarray, np.ndarray]:
    """[b, gh, gw] CAMs of ``method`` (a key of ``CAM_CLASSES``) for targets ``t``, one forward and (for the
    gradient CAMs) one backward for the batch. ``params['target_layer']`` None picks ``default_target_layer``;
    the name used is written back into ``params`` (so the result records it)."""
    pkg = grad_cam_package()
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    name = params.get("target_layer") or default_cam_layer(m)
    layer = resolve_target_layer(m, name)
    params["target_layer"] = name
    reshape = (stage_reshape([g for g, _s in stage_layouts(m)], x.shape[0], name) if kind_of(m).stages
               else token_reshape(m.spec, grid, x.shape[0], name))
    cam = getattr(pkg, CAM_CLASSES[method])(_Scored(m.model, score), [layer], reshape_transform=reshape)
    try:
        xi = x.detach().clone().requires_grad_(True)  # the weights are frozen: the graph starts at the input
        with torch.enable_grad():
            out = cam.activations_and_grads(xi)
            if cam.uses_gradients:
                assert t is not None, f"{method} needs a target"  # attribute() passes one (Method.needs_target)
                torch.autograd.grad(out.float().gather(1, t[:, None]).sum(), xi)  # the hooks record the layer's grad
        recorded = cam.activations_and_grads
        if len(recorded.activations) != 1 or (cam.uses_gradients and len(recorded.gradients) != 1):
            raise InvalidParameterError(f"target_layer {name!r} ran {len(recorded.activations)} times in one forward "
                                        "(or got no gradient); name a module that runs once, on the tokens.")
        acts = recorded.activations[0].numpy()
        grads = recorded.gradients[0].numpy() if cam.uses_gradients else None
    finally:
        cam.activations_and_grads.release()  # before ScoreCAM's forwards, which the hooks must not record
    if method == "scorecam":
        weights = _score_cam_weights(score, x.detach(), acts, t, int(params["masked_per_forward"]))
        maps = (weights[:, :, None, None] * acts).sum(axis=1)
    else:
        targets = [ClassifierOutputTarget(int(c)) for c in t.tolist()] if t is not None else None
        maps = cam.get_cam_image(xi, layer, targets, acts, grads, eigen_smooth=False)
    if t is None:  # a class-agnostic CAM (eigencam) asked without a target records the prediction, as rollout does
        explained = out.detach().argmax(-1) if m.spec.num_classes > 0 else torch.full((x.shape[0],), -1)
    else:
        explained = t
    return np.maximum(maps, 0).astype(np.float64), explained.cpu().numpy()
