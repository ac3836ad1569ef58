"""Class-specific attributions beside rollout, all on one contract: images in, [B, gh, gw] maps out.

Rollout (paper Fig. 6) shows where information was mixed across layers, not what caused a
prediction. This module lines it up against methods that look at the target class:

- ``rollout``: the library's attention rollout (class-agnostic; the target is recorded only);
- ``grad_rollout``: gradient-weighted rollout (Chefer et al., 2021, "Generic Attention-model
  Explainability"): per block, the mean over heads of clamp(dA ⊙ A, 0), where dA is the gradient
  of the target logit with respect to that block's own attention, accumulated R <- R + Ā R
  from the first block to the last;
- ``spatial_decomposition``: each patch token's direct contribution, summed over layers and heads, to the target
  (Gandelsman et al., 2024: their zero-shot segmentation; ``spatial``);
- captum's ``integrated_gradients``, ``saliency``, ``input_x_gradient`` (pixel attributions
  summed over channels and over each token's pixel block) and ``occlusion`` (window and stride
  aligned to tokens: by default one token, so every token is occluded once and its score drop is
  its value; ``window_tokens``/``stride_tokens`` make coarser, cheaper passes).

No method changes the model: its weights have ``requires_grad=False``
(vitlens freezes them at load), gradients come from ``torch.autograd.grad`` on the input, so no
``.grad`` is ever left on the model, and capture hooks are removed even when a method fails.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from ..errors import InvalidParameterError, UnsupportedModelError
from ..images import Images, count_images, iter_batches
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..kinds import Kind, all_kinds, find_kind, has_cam_layer, has_token_attention, kind_of, takes_images
from ..views.registry import VIEWS
from .cam import CAM_CLASSES, CAM_INSTALL, CAM_PACKAGE, cam_maps, stage_layouts
from .lrp import AttnLRPMaps, attnlrp_maps
from .builtin import (Scorer, class_scorer, grad_rollout_maps, input_x_gradient_maps, integrated_gradients_maps,
                      occlusion_maps, rollout_maps, saliency_maps)
from .result import AttributionResult
from .spatial import spatial_decomposition_maps, spatial_refusal
from .text import SCORE, TextTargets, has_text_tower, is_text_target
from .tower_targets import DIRECTION_SCORE, OutputTarget, is_headless


def _targets(m: LoadedModel, x: torch.Tensor, target: Any) -> torch.Tensor:
    if m.spec.num_classes <= 0:
        if has_text_tower(m):  # CLIP / SigLIP: the map explains the similarity to a prompt
            raise InvalidParameterError(f"{m.spec.name} has a text tower and no classifier head: give the prompt "
                                        "to explain, e.g. target=\"a photo of a dog\" (the image's similarity to it).")
        agnostic = [name for name in methods_for(m) if not METHOD_TABLE[name].needs_target]
        raise InvalidParameterError(f"{m.spec.name} has no classifier head, so there is no class to attribute; "
                                    f"use a class-agnostic method ({', '.join(agnostic)}) or a model with a head.")
    if target is None:
        return m.logits(x).argmax(-1)
    t = torch.as_tensor(target, dtype=torch.long, device=m.device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(x.shape[0])
    if t.numel() != x.shape[0] or t.min() < 0 or t.max() >= m.spec.num_classes:
        raise InvalidParameterError(f"target must be one class index or one per image, in [0, {m.spec.num_classes}); "
                                    f"got {target!r}.")
    return t


MethodFn = Callable[[LoadedModel, torch.Tensor, Any, tuple, dict, Scorer], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Method:
    """One attribution method: its function, default parameters, and what its maps mean.

    Attributes:
        name: the name ``attribute`` takes.
        fn: (model, batch, targets, grid, params, score) -> (maps [b, gh, gw], targets [b]); ``score``
            maps a batch to [b, K] outputs (class logits, or similarities to K prompts) that ``targets`` index.
        defaults: parameters and their defaults (the only ones it accepts).
        needs_target: False for class-agnostic maps (rollout, eigencam), which work without a classifier.
        note: what the map means, when that needs saying.
        slow: left out of ``compare_methods``'s default (``default_methods``) and so of the report's.
        quick: cheap enough for the cascading randomisation (one forward and at most one backward per
            image, run L + 2 times): ``sanity.QUICK_METHODS``, what the report's sanity check runs.
        preselected: one of the few methods the app preselects and ``sanity_table`` runs by default.
        package: the extra package (its import name) the method needs, "" for none; ``install`` says how
            to get it. A method whose package is missing is left out of ``available_methods``.
        rollout_row: the map is a row of a rolled-out attention product, so a model without a class token
            gets the mean over the patch tokens' rows (``attribute`` says so in the note).
        variant_of: the method this one is a named variant of ("" for none): the variant is offered wherever the
            table is read (``attribute``, the CLI's and the report's choices, the app) but left out of
            ``default_methods``, so a default comparison runs each method once.
        label: the name a person reads in figures' legends and tables ("gradient rollout"); ``method_label`` falls
            back to the name with spaces for a method registered without one.
        refuses: for a method defined on only some models of a kind, (model) -> why it is not defined for that
            model ("" where it is), asked by ``attribute`` before any map is made (the spatial decomposition: the
            models ``vl.decompose`` reads); None for a method defined on every model of its kinds.
        for_kind: which kinds of model (``vitlens.kinds.Kind``) the method is defined for, as a test of the kind's
            record; ``kinds`` lists the registered kinds that pass it. A method that reads a ViT's token-by-token
            attention over one sequence ([B, H, T, T] maps, a class token's row: gradient rollout, AttnLRP) is
            defined where ``Kind.token_attention`` (``has_token_attention``, the default), not on a hierarchical
            model's windows and stages or a CaiT's two kinds of block; the input-space methods (captum's) are
            defined for every differentiable model of one image (``takes_images``: not a video model's clip), the
            CAMs where the family names their layer (``has_cam_layer``; on a stage's grid), and rollout wherever the
            rollout view reads the model's maps (the windowed rollout, a CaiT's from its class token). ``attribute``
            refuses a method outside its kinds and names those defined (``methods_for``); the app, the report and the
            CLI offer only those.
    """

    name: str
    fn: MethodFn
    defaults: dict = field(default_factory=dict)
    needs_target: bool = True
    note: str = ""
    slow: bool = False
    quick: bool = False
    preselected: bool = False
    package: str = ""
    install: str = ""
    rollout_row: bool = False
    variant_of: str = ""
    for_kind: Callable[[Kind], bool] = has_token_attention
    label: str = ""
    refuses: Callable[[LoadedModel], str] | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The registered kinds (``ModelSpec.kind`` values) the method is defined for (``for_kind``)."""
        return tuple(k.name for k in all_kinds() if self.for_kind(k))

    @property
    def class_agnostic(self) -> bool:
        """The same map for every target (no classifier needed)."""
        return not self.needs_target

    def available(self) -> bool:
        """Whether its extra package is installed (``package_available``)."""
        return not self.package or package_available(self.package)


def package_available(package: str) -> bool:
    """Whether ``package`` (an import name) is installed, found without importing it (grad-cam pulls opencv)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def has_rollout_view(kind: Kind) -> bool:
    """Defined wherever the rollout view has a consumer that reads the kind's maps (``View.kinds``: through a
    hierarchical model's windows, a CaiT's class-attention layers)."""
    return kind.name in VIEWS["rollout"].kinds


#: the CAMs' names as their papers write them (a legend's label, ``Method.label``)
CAM_LABELS = {"gradcam": "Grad-CAM", "gradcam++": "Grad-CAM++", "xgradcam": "XGrad-CAM", "hirescam": "HiResCAM",
              "layercam": "LayerCAM", "eigencam": "Eigen-CAM", "eigengradcam": "Eigen-Grad-CAM",
              "scorecam": "Score-CAM"}

METHOD_TABLE: dict[str, Method] = {mt.name: mt for mt in (
    # rollout of a hierarchical model: through its windows and patch mergings (vl.attention_rollout)
    Method("rollout", rollout_maps, {"head_fusion": "mean", "discard_ratio": 0.0}, needs_target=False,
           note="class-agnostic: the same map for every target", quick=True, preselected=True, rollout_row=True,
           for_kind=has_rollout_view, label="attention rollout"),
    Method("grad_rollout", grad_rollout_maps, quick=True, preselected=True, rollout_row=True, label="gradient rollout"),
    # captum's input-space methods: gradients or occlusions of the input, defined for any differentiable model
    Method("integrated_gradients", integrated_gradients_maps, {"n_steps": 16}, for_kind=takes_images,
           label="integrated gradients"),  # captum's 50: slow
    Method("saliency", saliency_maps, quick=True, preselected=True, for_kind=takes_images, label="saliency"),
    Method("input_x_gradient", input_x_gradient_maps, quick=True, for_kind=takes_images, label="input × gradient"),
    Method("occlusion", occlusion_maps, {"window_tokens": 1, "stride_tokens": 1, "perturbations_per_eval": 16},
           for_kind=takes_images, label="occlusion"),
    # the Grad-CAM family (vitlens.attribution.cam): target_layer None = the last block's pre-attention norm
    # (a hierarchical model: the last stage's last block, on that stage's grid); scorecam's masked_per_forward:
    # masked images per forward
    *(Method(name, partial(cam_maps, method=name),
             {"target_layer": None, **({"masked_per_forward": 64} if name == "scorecam" else {})},
             needs_target=name != "eigencam", package=CAM_PACKAGE, install=CAM_INSTALL["python"],
             slow=name == "scorecam", quick=name == "gradcam", for_kind=has_cam_layer,
             label=CAM_LABELS[name],
             note=("class-agnostic: the first principal component of the layer's patch tokens (its sign is the SVD's)"
                   if name == "eigencam" else "")) for name in CAM_CLASSES),
    Method("attnlrp", attnlrp_maps, note="relevance (AttnLRP); biases and the softmax absorb part of the logit",
           label="AttnLRP"),
    # Gandelsman et al.'s segmentation from the spatial decomposition (vitlens.attribution.spatial): one forward,
    # defined where ``vl.decompose`` reads the model (refused in its words elsewhere)
    Method("spatial_decomposition", spatial_decomposition_maps, refuses=spatial_refusal,
           note="each token's direct contribution through every head (decompose), signed; the MLPs' and the "
                "embeddings' parts are left out", label="spatial decomposition"),
    # AttnLRP as its authors run it on ViTs (vitlens.attribution.lrp.LRPRules): the γ-rule in the linear layers
    # (gamma) and the patch embedding (conv_gamma); CP-LRP's constant attention inside the attention, which lxt
    # recommends for ViTs together with the γ-rule outside it (gamma 0 there: Ali et al.'s CP-LRP as published)
    Method("attnlrp_gamma", AttnLRPMaps("uniform"), {"gamma": 0.25, "conv_gamma": 0.25},
           note="relevance (AttnLRP, γ-rule in the linear and convolution layers); biases and the softmax absorb part "
                "of the logit", variant_of="attnlrp", label="AttnLRP (γ-rule)"),
    Method("cp_lrp", AttnLRPMaps("cp"), {"gamma": 0.0, "conv_gamma": 0.0},
           note="relevance (CP-LRP: attention probabilities held constant); biases absorb part of the logit",
           variant_of="attnlrp", label="CP-LRP"),
)}


def method_names() -> tuple[str, ...]:
    """Every registered method's name, read from ``METHOD_TABLE`` when called (a method registered later is in it).

    Returns:
        The names, in the table's order (the built-in methods first).
    """
    return tuple(METHOD_TABLE)


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS``: ``method_names()``, read from the table when asked (no snapshot taken at import)."""
    if name == "METHODS":
        return method_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: methods left out of ``compare_methods``'s default (``Method.slow``): scorecam runs masked_per_forward-sized
#: batches of masked images per image (one forward per masked_per_forward images, for every channel of the layer)
SLOW_METHODS: tuple[str, ...] = tuple(name for name, mt in METHOD_TABLE.items() if mt.slow)


def register_method(method: Method) -> Method:
    """Add ``method`` to ``METHOD_TABLE``; ``attribute``, ``compare_methods``, the report and the app read it
    from there.

    Args:
        method: the method's entry (``Method``).

    Returns:
        ``method``.

    Raises:
        InvalidParameterError: a method of that name is registered already.
    """
    if method.name in METHOD_TABLE:
        raise InvalidParameterError(f"an attribution method named {method.name!r} exists already.")
    METHOD_TABLE[method.name] = method
    return method


def method_label(method: str) -> str:
    """The name a person reads for ``method``: its entry's ``label``, else (a method registered without one, or a
    name the table does not hold) the name with spaces for underscores.

    Args:
        method: a method's name.

    Returns:
        The label.
    """
    mt = METHOD_TABLE.get(method)
    return (mt.label if mt is not None else "") or method.replace("_", " ")


def available_methods() -> tuple[str, ...]:
    """Every method whose extra package (``Method.package``) is installed here."""
    return tuple(name for name, mt in METHOD_TABLE.items() if mt.available())


def missing_packages() -> dict[str, str]:
    """For the methods left out of ``available_methods``: their package -> how to install it."""
    return {mt.package: mt.install for mt in METHOD_TABLE.values() if not mt.available()}


def _kind(model: Any) -> str | None:
    """The ``ModelSpec.kind`` of a ``LoadedModel``, a spec or a kind's name; None for None."""
    if model is None or isinstance(model, str):
        return model
    return getattr(model, "spec", model).kind


def _defined(mt: Method, model: Any) -> bool:
    """Whether ``mt`` is defined for ``model``: its kind, and, for a ``LoadedModel``, the method's own refusal
    (``Method.refuses``) says nothing."""
    if _kind(model) not in mt.kinds:
        return False
    return not (isinstance(model, LoadedModel) and mt.refuses is not None and mt.refuses(model))


def methods_for(model: Any) -> tuple[str, ...]:
    """The methods of ``METHOD_TABLE`` defined for ``model``'s kind of model (``Method.kinds``): a
    ``LoadedModel``, its spec, or a kind's name (``vitlens.kinds``); for a ``LoadedModel``, less those that refuse
    it (``Method.refuses``). What ``attribute`` accepts for it and what the app, the report and the CLI offer (those
    whose package is missing included: ``available_methods``)."""
    return tuple(name for name, mt in METHOD_TABLE.items() if _defined(mt, model))


def default_methods(model: Any = None) -> tuple[str, ...]:
    """``compare_methods``'s default: every method that is available here (the CAMs need grad-cam), not slow and
    not a named variant of another (``Method.variant_of``: ``attnlrp_gamma``, ``cp_lrp``); given a model (or its
    kind), only those defined for it (``methods_for``)."""
    return tuple(name for name in available_methods()
                 if not METHOD_TABLE[name].slow and not METHOD_TABLE[name].variant_of
                 and (model is None or _defined(METHOD_TABLE[name], model)))


def preselected_methods(model: Any = None) -> tuple[str, ...]:
    """The few methods the app preselects and ``sanity_table`` runs by default (``Method.preselected``); given a
    model (or its kind), only those defined for it."""
    return tuple(name for name, mt in METHOD_TABLE.items() if mt.preselected and (model is None or _defined(mt, model)))


def refusal(m: LoadedModel, method: str) -> str:
    """One line: why ``method`` is not defined for ``m``'s kind of model (or, where it refuses some models of the
    kind, for ``m``: ``Method.refuses``), and which methods are."""
    mt, kind = METHOD_TABLE[method], find_kind(m)
    own = mt.refuses(m) if mt.refuses is not None and m.spec.kind in mt.kinds else ""
    if own:  # defined for the kind, refused for this model in the method's own words (``Method.refuses``)
        why = own.rstrip(".")
    elif kind is not None and kind.method_refusal:  # the kind's own words (``Kind.method_refusal``)
        why = kind.method_refusal.format(method=method, name=m.spec.name)
    else:
        why = f"{method} is defined for {', '.join(mt.kinds)} models and {m.spec.name} is a {m.spec.kind} model"
    return f"{why}; the methods defined for it: {', '.join(methods_for(m)) or 'none'}."


def map_stride(m: LoadedModel, grid: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
    """(sy, sx) pixels between the cells of a map on ``grid`` for inputs of ``size``: the patch stride on the
    patch-token grid, a stage's stride on that stage's grid (a hierarchical model's CAM); else the size over the
    grid, rounded up."""
    if tuple(grid) == tuple(m.grid_for(size)):
        return int(m.spec.stride_px[0]), int(m.spec.stride_px[1])
    for g, stride in stage_layouts(m):
        if tuple(g) == tuple(grid):
            return stride
    return (-(-int(size[0]) // int(grid[0])), -(-int(size[1]) // int(grid[1])))


def map_grids(m: LoadedModel, size: tuple[int, int]) -> list[tuple[int, int]]:
    """The grids a map of ``m`` may be on for inputs of ``size``: its patch-token grid, and a hierarchical model's
    stage grids (its CAMs')."""
    gh, gw = m.grid_for(size)
    grids: list[tuple[int, int]] = [(int(gh), int(gw))]
    if kind_of(m).stages:
        grids += [(int(g[0]), int(g[1])) for g, _s in stage_layouts(m) if tuple(g) not in grids]
    return grids


def attribute(
    m: LoadedModel,
    images: Images,
    method: str = "rollout",
    target: Any = None,
    batch_size: int = 16,
    progress: ProgressArg = None,
    tokenizer: Any = None,
    **params: Any,
) -> AttributionResult:
    """Attribution maps on the patch grid for the target class (default: the predicted class), or for a prompt.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        method: one of ``METHODS``.
        target: class index for all images, one per image, or None for each image's prediction; for a
            model with a text tower (CLIP, SigLIP), a prompt ("a photo of a dog"), one prompt per image, or
            pre-tokenised ids ({"input_ids": [P, L], ...}): the map explains the cosine similarity of the
            image embedding and the prompt's text embedding (``vitlens.attribution.text``); for a tower with
            neither a classifier head nor a text tower, None (the map explains the output's norm) or a direction,
            a vector of the output's size (its cosine similarity to the output: ``tower_targets``).
        batch_size: images per step.
        progress: True for a progress bar, or a callable ``f(done, total)``.
        tokenizer: for a text target, the text tower's tokenizer when vitlens cannot find it (a Hugging Face
            model built from a config): a Hugging Face tokenizer, or a callable prompts -> ids [P, L].
        **params: method parameters (``n_steps`` for integrated gradients, ``perturbations_per_eval``
            for occlusion, ``head_fusion`` / ``discard_ratio`` for rollout, ``target_layer`` for the CAMs
            (a module name; default the last block's pre-attention norm), ``masked_per_forward`` for scorecam,
            ``gamma`` / ``conv_gamma`` for ``attnlrp_gamma`` and ``cp_lrp``: the γ of the γ-rule in the linear layers
            and in the convolutions, 0 for the epsilon rule).

    Returns:
        An ``AttributionResult``; its ``maps`` are [B, gh, gw]; for a text target ``label_names`` are the
            prompts, ``targets`` index them and ``params['score']`` says what was explained.
    """
    if method not in METHOD_TABLE:
        raise InvalidParameterError(f"method must be one of {', '.join(METHOD_TABLE)}; got {method!r}.")
    spec = METHOD_TABLE[method]
    if m.spec.kind not in spec.kinds:
        raise UnsupportedModelError(refusal(m, method))
    if spec.refuses is not None and spec.refuses(m):
        raise UnsupportedModelError(refusal(m, method))
    unknown = set(params) - set(spec.defaults)
    if unknown:
        raise InvalidParameterError(f"{method} takes {', '.join(spec.defaults) or 'no parameters'}; "
                                    f"got {', '.join(sorted(unknown))}.")
    p = {**spec.defaults, **params}
    text, explained = None, {}
    if is_text_target(target):
        # rollout is class-agnostic: its map ignores the prompt, which is recorded (and embedded, so that
        # deletion / insertion can score the map against it as against a class)
        text = TextTargets(m, target, count_images(images), tokenizer)
        explained["score"] = SCORE if spec.needs_target else "none (class-agnostic); the prompt is recorded only"
    # a tower without classes or prompts: its output's norm, or a direction, is what a map explains (tower_targets)
    tower = OutputTarget(m, target) if text is None and is_headless(m) else None
    if tower is not None:
        explained["score"] = (tower.name if spec.needs_target else
                              f"none (class-agnostic); {tower.name} is recorded only")
    score = text.scorer(m) if text is not None else tower.scorer(m) if tower is not None else class_scorer(m)
    maps: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    grid: tuple[int, int] | None = None
    size: tuple[int, int] | None = None
    map_grid: tuple[int, int] | None = None
    done = 0
    start = time.perf_counter()
    with Progress(progress, count_images(images), method) as bar:
        for x in iter_batches(images, m.data_config, batch_size):
            x = x.to(m.device)
            grid, size = m.grid_for(x.shape[-2:]), (int(x.shape[-2]), int(x.shape[-1]))
            t: torch.Tensor | None  # None: a class-agnostic method with no target asked
            if text is not None:
                t = text.batch(done, x.shape[0], m.device)
            elif tower is not None:
                t = tower.batch(x.shape[0], m.device)
            else:
                batch_target = target
                if target is not None and np.ndim(target) > 0 and len(target) > 1:
                    batch_target = list(target)[done: done + x.shape[0]]
                t = None if (target is None and not spec.needs_target) else _targets(m, x, batch_target)
            batch_maps, batch_targets = spec.fn(m, x, t, grid, p, score)
            map_grid = (int(batch_maps.shape[1]), int(batch_maps.shape[2]))  # a CAM's layer may be on a coarser grid
            maps.append(batch_maps)
            targets.append(np.asarray(batch_targets))
            done += x.shape[0]
            bar.update(done)
    elapsed = time.perf_counter() - start
    if grid is None or size is None:  # iter_batches refuses an empty image set before any batch
        raise InvalidParameterError("No images given: pass at least one image.")
    notes = [spec.note] if spec.note else []
    if spec.rollout_row and not m.spec.has_class_token:
        notes.append("no class token: mean over the patch tokens' rows")
    if text is not None and spec.needs_target:
        notes.append("explains the image-text cosine similarity to the prompt")
    if tower is not None and spec.needs_target:
        explains = tower.name if tower.direction is None else f"the {DIRECTION_SCORE}"
        notes.append(f"no classifier head: explains {explains}")
    stride = map_stride(m, map_grid, size) if map_grid is not None else tuple(m.spec.stride_px)
    if map_grid is not None and map_grid != tuple(grid):
        layouts = stage_layouts(m)
        stage = next((i for i, (g, _s) in enumerate(layouts) if g == map_grid), None)
        where = ("the layer's" if stage is None else
                 f"stage {stage + 1}'s" + (" (the last)" if stage == len(layouts) - 1 else ""))
        notes.append(f"on {where} {map_grid[0]}x{map_grid[1]} grid ({stride[0]} px cells), coarser than the "
                     f"{grid[0]}x{grid[1]} patch grid ({m.spec.stride_px[0]} px) of the first stage")
        grid = map_grid
    return AttributionResult(method=method, maps=np.concatenate(maps).astype(np.float64),
                             targets=np.concatenate(targets).astype(np.int64), grid=grid, image_size=size,
                             stride_px=stride,
                             seconds_per_image=elapsed / max(done, 1), params={**p, **explained}, note="; ".join(notes),
                             model_name=m.spec.name,
                             label_names=(list(text.names) if text is not None else [tower.name] if tower is not None
                                          else list(m.label_names() or [])),
                             target_kind="text" if text is not None else tower.kind if tower is not None else "class",
                             text_embeddings=(text.embeddings.cpu().numpy().astype(np.float32) if text is not None
                                              else tower.embeddings() if tower is not None else None))
