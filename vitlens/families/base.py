"""What a model family tells vitlens: its spec, where its attention is computed and how to capture
it exactly, its pixel-space embedding filters, its position-embedding table and its learned
relative-position bias.

Every view of the paper reads a model only through this interface. A new family (BEiT, EVA, Hugging
Face, torchvision, ...) is its module in ``vitlens/families/`` and its name on the import line of
``vitlens/families/__init__.py``: the module says everything about it (its ``summary`` in the refusals'
``supported_families``, a Hugging Face family's model types, processor defaults and attention implementation in
``hf_types``, the optional abilities it has) and imports this module and the helper layer
``vitlens.families.common``, never another family's module; a new name prefix (``hf:``, ``open_clip:``) is
``vitlens/loading/``'s. The family says what else reads it: its capture's abilities
(``abilities``: what ``capture_plan`` chooses from) and the input of its blocks' attention
(``attention_input``: the Grad-CAM family's default layer). A family that reads a model through another
family's reading of a module inside it is an ``Adapter``, which hands every method it does not write to
the inner family. AttnLRP's rules are by layer type (GELU, GLU/SwiGLU MLPs, RMSNorm, matched by class in
``attribution/lrp.py``), not by family, as zennit's composites map layer types to rules.
The capture guarantee is the family's to keep:

- ``side`` capture leaves the model's own forward untouched (its outputs bit-for-bit those of a
  run without capture) and computes the post-softmax probabilities beside it from the very
  queries and keys the block uses;
- ``inline`` capture runs the family's own non-fused attention path and hands over the
  probabilities the output is computed from (no extra work; what gradient methods need).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec

if TYPE_CHECKING:
    from ..core.windows import WindowGeometry
    from .relative_bias import RelativeBias

Emit = Callable[..., None]
"""Where a capture sends each block's probabilities: ``emit(layer, probs)`` with a whole map [B, heads, T, T],
or ``emit(layer, probs, rows)`` with the query rows ``rows`` of it (see ``vitlens.engine.stream``)."""


@dataclass(frozen=True)
class CaptureRequest:
    """What a family's install receives: one explicit object saying what to capture and where to send it.

    Calling the request hands a block's probabilities on: ``request(layer, probs)`` (a whole map) or
    ``request(layer, probs, rows)`` (the query rows ``rows`` of it).

    Attributes:
        emit: where each block's probabilities go (``Emit``).
        mode: "side" (beside the model's own forward, its outputs untouched) or "inline" (the family's
            non-fused path; the maps are the ones the output is computed from).
        query_rows: how many query rows the family may compute at a time (None: whole maps). A family that
            cannot go by rows makes whole maps (``CaptureAbilities`` says which can).
        detach: inline only: hand over detached probabilities (False: in the autograd graph).
        views: whether views listen (streaming consumers, which read every token as a patch of one grid):
            a family refuses inputs whose tokens are not that (padded or packed batches) when they do.
        taps: ``taps(layer, rows, shape)``: what the views want a block of query rows' softmax pass to compute
            besides the probabilities (``vitlens.core.native.SoftmaxTaps``, or None); a family that computes the
            probabilities by rows passes ``taps_for(layer)`` to ``attention_probs_in_rows``. None: nothing asked.
    """

    emit: Emit
    mode: str = "side"
    query_rows: int | None = None
    detach: bool = True
    views: bool = False
    taps: Callable[[int, slice, tuple], Any] | None = None

    def taps_for(self, layer: int) -> Callable[[slice, tuple], Any] | None:
        """Block ``layer``'s ``taps`` as ``attention_probs_in_rows`` asks them (None when nothing is asked)."""
        taps = self.taps
        if taps is None:
            return None
        return lambda rows, shape: taps(layer, rows, shape)

    def __call__(self, layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        if rows is None:
            self.emit(layer, probs)
        else:
            self.emit(layer, probs, rows)

    def sending_to(self, emit: Emit) -> "CaptureRequest":
        """The same request with its probabilities sent to ``emit`` (a family's adapter of the maps)."""
        return dataclasses.replace(self, emit=emit)


@dataclass(frozen=True)
class CaptureAbilities:
    """What a family's capture can do for a model (``Family.abilities``): what ``capture_plan`` reads.

    Attributes:
        has_inline: a non-fused path exists that inline capture reads.
        view_mode: the capture the views use: "inline" where the family's own non-fused path is cheaper than
            computing the probabilities a second time beside the fused one (measured by analyses/bench.py).
        side_rows: side capture computes the probabilities a block of query rows at a time when asked.
        inline_rows: inline capture computes the block's attention a block of query rows at a time when asked
            (the probabilities made once, the output computed from them, no whole map).
    """

    has_inline: bool = True
    view_mode: str = "inline"
    side_rows: bool = False
    inline_rows: bool = False


class Handles:
    """Hooks and attribute changes a capture installed, undone in reverse order by ``remove``.

    Made by a ``HookSession`` with its thread (``owner``) and the forward-hook tables of its model's modules
    (``forward_tables``): a forward hook or pre-hook put in one of those tables, and a ``forward`` replaced with
    ``set_attr``, then act only on the owner's forwards. A forward another thread runs meanwhile (a plain
    ``module(x)`` that does not wait for the model's lock) runs as without the session: its hooks return at once
    and the replaced ``forward`` calls the one it replaced, so it is never counted in the session's maps or
    statistics and never meets the session's per-forward state."""

    def __init__(self, owner: int | None = None, forward_tables: frozenset[int] = frozenset()) -> None:
        self._undo: list[Callable[[], None]] = []
        self._owner = owner
        self._tables = forward_tables

    def _mine(self) -> bool:
        return self._owner is None or threading.get_ident() == self._owner

    def hook(self, handle: Any) -> None:
        table = handle.hooks_dict_ref() if hasattr(handle, "hooks_dict_ref") else None
        if self._owner is not None and table is not None and id(table) in self._tables and handle.id in table:
            fn = table[handle.id]

            def owners_only(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if self._mine() else None

            table[handle.id] = owners_only
        self._undo.append(handle.remove)

    def on_remove(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)`` now, the previous value put back by ``remove`` (an attribute the
        object had from its class, e.g. a module's ``forward``, is deleted again, so the class's is seen).
        A module's ``forward`` is replaced for the owner's thread only (the others call the previous one)."""
        # an attribute the class provides and setattr shadows (a method) is deleted again; an instance
        # attribute, or one a descriptor of the class stores (a property), is set back
        shadowed = name not in getattr(obj, "__dict__", {}) and \
            not hasattr(inspect.getattr_static(type(obj), name, None), "__set__")
        previous = getattr(obj, name)
        if name == "forward" and self._owner is not None and isinstance(obj, nn.Module) and callable(value):
            replacement = value

            @functools.wraps(replacement)
            def value(*args: Any, **kwargs: Any) -> Any:  # the owner's replacement, or the previous forward
                return (replacement if self._mine() else previous)(*args, **kwargs)

        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name) if shadowed else setattr(obj, name, previous))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


_OBJECT_LOCKS: dict[int, "threading.RLock"] = {}
_LOCKS_GUARD = threading.Lock()


def _object_lock(obj: object) -> "threading.RLock | None":
    """The re-entrant lock of one object (by identity; forgotten when the object is), or None for an object that
    takes no weak reference."""
    key = id(obj)
    with _LOCKS_GUARD:
        lock = _OBJECT_LOCKS.get(key)
        if lock is None:
            try:
                weakref.finalize(obj, _OBJECT_LOCKS.pop, key, None)
            except TypeError:
                return None
            lock = _OBJECT_LOCKS[key] = threading.RLock()
        return lock


def shared_parts(module: nn.Module) -> list[object]:
    """What a hook session on ``module`` may change, and other models may share: the module, every module inside it
    (a model and its ``.vit`` tower share theirs) and the configuration objects they carry (transformers gives every
    model built from one config the same object, whose ``_attn_implementation`` a capture switches)."""
    parts: dict[int, object] = {}
    for mod in module.modules():
        parts[id(mod)] = mod
        config = getattr(mod, "config", None)
        if config is not None and not isinstance(config, (nn.Module, dict, str, int, float, bool, tuple, list)):
            parts[id(config)] = config
    return list(parts.values())


class SharedLock:
    """The lock of a model module and of everything it shares (``shared_parts``): ``acquire`` takes the lock of each
    part, always in one global order (by the locks' identities), so two sessions on models that share a part (two
    models of one config, a model and its tower) run one after the other and never deadlock on each other.
    Re-entrant on the holding thread, as ``threading.RLock``; usable as ``with lock:``."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self._held = threading.local()

    def _locks(self) -> list["threading.RLock"]:
        module = self._module()
        found = {} if module is None else {id(lock): lock for lock in map(_object_lock, shared_parts(module))
                                           if lock is not None}
        return [found[k] for k in sorted(found)]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take every part's lock (waiting at most ``timeout`` seconds in all; none taken when it runs out)."""
        import time

        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        taken: list[threading.RLock] = []
        try:
            for lock in self._locks():
                left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
                if not lock.acquire(blocking, left if blocking else -1):
                    break
                taken.append(lock)
            else:
                self._stack().append(taken)
                return True
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise
        for lock in reversed(taken):
            lock.release()
        return False

    def release(self) -> None:
        for lock in reversed(self._stack().pop()):
            lock.release()

    def _stack(self) -> list[list["threading.RLock"]]:
        stack = getattr(self._held, "stack", None)
        if stack is None:
            stack = self._held.stack = []
        return stack

    def __enter__(self) -> "SharedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_LOCKS: "weakref.WeakKeyDictionary[nn.Module, SharedLock]" = weakref.WeakKeyDictionary()


def model_lock(module: nn.Module) -> SharedLock:
    """The lock of a model module (``LoadedModel.lock``, a ``SharedLock``): every hook session on it holds it from
    install to removal, and ``LoadedModel.forward`` holds it for the forward, so a second thread waits until the
    first thread's session is over and its hooks never see the other thread's forwards. It covers what the model
    shares with others (``shared_parts``): a session on another model built from the same config, or on the
    model's tower, waits too. Re-entrant: the sessions one capture nests (a view's pool or token-norm hooks) and
    their forwards run on the holding thread. A plain ``module(x)`` from user code in another thread does not take
    it: it runs as if no session were on (``Handles``), and is never counted in a view."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = SharedLock(module)
        return lock


def _forward_tables(module: nn.Module) -> frozenset[int]:
    return frozenset(id(t) for mod in module.modules() for t in (mod._forward_hooks, mod._forward_pre_hooks))


class HookSession:
    """The one managed hook mechanism: a context manager whose ``install(handles)`` puts its hooks
    (and attribute changes) on a model when the ``with`` block starts; every one is removed when
    it ends, by an exception too, and by a failure half-way through installing. Attention
    capture, pool attention, token norms, CKA features, head ablation and AttnLRP's mode are all
    sessions, and each holds its model's lock (``model_lock``) while it is active: two threads'
    sessions on one model run one after the other, never mixed."""

    _handles: Handles | None = None
    _lock: Any = None

    def install(self, handles: Handles) -> None:
        raise NotImplementedError

    def locked_module(self) -> nn.Module | None:
        """The model whose lock the session holds: its ``model`` (or its LoadedModel ``m``'s) by default."""
        model = getattr(self, "model", None)
        if model is None and getattr(self, "m", None) is not None:
            model = getattr(self.m, "model", None)
        return model if isinstance(model, nn.Module) else None

    def __enter__(self):  # noqa: ANN204 (returns the session itself, whatever its subclass)
        if self._handles is not None:
            raise RuntimeError(f"This {type(self).__name__} is already active; nest a new one instead.")
        module = self.locked_module()
        lock = model_lock(module) if module is not None else None
        if lock is not None:
            lock.acquire()
        self._lock = lock
        self._handles = Handles(threading.get_ident(), _forward_tables(module) if module is not None else frozenset())
        try:
            self.install(self._handles)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._handles is not None:
                self._handles.remove()
        finally:
            self._handles = None
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.release()


class Family:
    """Base class of the model families; subclasses fill in every method.

    Optional abilities. A family whose models are not one global attention over one token grid declares, as its own
    methods, what the views and methods read of them; every other family keeps the default here, None (read as "the
    family has no such ability": callers test ``family.windows is None``, never ``getattr``):

    - ``windows(model, input_hw) -> list[WindowGeometry]``: every block's windows (Swin, SAM / ViTDet, Hiera, MViT v2,
      PVT: ``spec.kind == "hierarchical"``);
    - ``stage_layout(model) -> [(token grid, pixel stride)]`` of every stage at the built size (the CAMs' stage grids;
      None: the spec's one grid);
    - ``block_heads(model) -> list[int]``: every block's heads, where its attention modules do not say ``num_heads``;
    - ``block_layout(model) -> list[dict]``: each block's kind and tokens, for blocks of more than one kind (CaiT);
    - ``packed_forward(model, images)``: images of different sizes in one packed forward (Pixtral);
    - ``cam_layer(model)`` (a method returning None by default) and ``hf_types`` (the transformers model types a
      family reads, ``vitlens.families.common.hf.HfTypes``).
    """

    #: short name, stored in ``ModelSpec.family``
    name = "family"
    #: the family in a few words, for the lists of what vitlens reads in its refusals (``supported_families``;
    #: the name where it says none)
    summary = ""
    #: which capture path the blocks take, in words, where it is not the family's own (``LoadedModel``'s repr)
    path = ""
    #: a fallback family is tried only after every other family and the refusals by name (``family_of``)
    fallback = False
    #: what the family reads, in words, and the model names that lead to it (``vitlens models``)
    reads = ""
    names: tuple[str, ...] = ()
    #: the family's ``abilities`` for every model it reads, unless it says otherwise per model
    capture = CaptureAbilities()
    #: the names a block's child module may have whose output is what the block's attention reads (the
    #: pre-attention norm), in the order they are looked for (``attention_input``)
    attention_inputs: tuple[str, ...] = ()

    def abilities(self, model: nn.Module) -> CaptureAbilities:
        """What capture can do for ``model`` (``capture_plan`` and ``capture_attention`` read it)."""
        return self.capture

    def attention_input(self, model: nn.Module, block: nn.Module) -> str | None:
        """The name of ``block``'s child whose output its attention reads (the pre-attention norm), or None
        when the family does not know it. The Grad-CAM family's default target layer is the last block's."""
        for child in self.attention_inputs:
            if isinstance(getattr(block, child, None), nn.Module):
                return child
        return None

    def cam_layer(self, model: nn.Module) -> str | None:
        """The module name the Grad-CAM family reads by default on a hierarchical model (``spec.kind ==
        "hierarchical"``): the last stage's last block's output, or the module the family names in its place, whose
        output is that stage's tokens ([B, H, W, C], [B, H * W, C] or [B, C, H, W]); None for a ViT, whose CAMs read
        the last block's ``attention_input``."""
        return None

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family (refusals included: ``check`` says why)."""
        raise NotImplementedError

    def check(self, model: nn.Module, name: str) -> None:
        """Raise ``UnsupportedModelError`` naming what this family cannot capture exactly."""
        raise NotImplementedError

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        """The model's spec; ``input_size`` is the (H, W) its preprocessing feeds it (None: the size it was
        built for). A family honours it (Hugging Face towers, timm models built with ``dynamic_img_size``) or
        refuses another size (``refuse_other_size``); none ignores it."""
        raise NotImplementedError

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The attention module of every block, first block first."""
        raise NotImplementedError

    #: the transformers model types the family reads, their processor defaults and the attention implementation
    #: ``hf:`` names load with (``vitlens.families.common.hf.HfTypes``); None for a family of no transformers models
    hf_types: Any = None

    #: ``windows(model, input_hw) -> list[WindowGeometry]`` for a family whose blocks attend within windows on stages
    #: of coarser grids (Swin: ``spec.kind == "hierarchical"``); None for global attention
    windows: "Callable[[nn.Module, Sequence[int]], list[WindowGeometry]] | None" = None
    #: ``stage_layout(model) -> [(token grid, pixel stride)]`` of every stage at the built size, for a family whose
    #: stages have grids of their own (Swin, PVT); None: the spec's one grid
    stage_layout: "Callable[[nn.Module], list[tuple[tuple[int, int], tuple[int, int]]]] | None" = None
    #: ``block_layout(model) -> list[dict]`` for a family whose blocks are of more than one kind (CaiT:
    #: ``spec.kind == "class-attention"``): each block's kind and the tokens of its queries and keys; None otherwise
    block_layout: Callable[..., Any] | None = None
    #: ``clip_layout(model) -> core.clip_layout.ClipLayout`` for a family of video models (``spec.kind ==
    #: "space-time"``): each token's time step and cell, the prefix tokens, and whether a block's maps are joint or
    #: divided; None for a family of image models
    clip_layout: Callable[..., Any] | None = None
    #: ``block_heads(model) -> list[int]``, the heads of every block's attention, for such a family whose attention
    #: modules do not say it as ``num_heads`` (Hugging Face's Swins); None: read ``num_heads``
    block_heads: Callable[..., Any] | None = None
    #: ``packed_forward(model, images) -> list[ImageTokens] | None``: one forward of preprocessed images of different
    #: sizes, packed in one sequence (Pixtral) or padded (Siglip2), under a capture, returning where each image's
    #: tokens stand in the maps (``core.tokens.ImageTokens``; None: the model takes no such batch, and
    #: ``vl.analyze_each`` runs the images one by one); None for a family of no such models
    packed_forward: Callable[..., Any] | None = None
    #: ``tower(model) -> nn.Module``, the submodule whose blocks the family reads when it reads a whole model through
    #: its vision tower (a CLIP model's ``vision_model``, Idefics3's); None: the model itself
    #: (``ModelSpec.read_module`` names it)
    tower: Callable[..., Any] | None = None

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """Side capture (``capture.mode == "side"``): every block's probabilities computed beside the model's
        own forward from the very queries and keys it uses, sent to ``capture`` (by ``capture.query_rows``
        where ``abilities(model).side_rows``); the model's outputs bit-for-bit those of a run without it."""
        raise NotImplementedError

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """Inline capture (``capture.mode == "inline"``): the family's non-fused path, whose probabilities are
        sent to ``capture`` (detached unless ``capture.detach`` is False) as the output is computed from them."""
        raise NotImplementedError

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        """(weight [D, C, kh, kw] float64, module name, description) of the pixel-space filters (Fig. 7 left)."""
        raise NotImplementedError

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """Side capture of the attention pool's own attention, for models that pool through one (a MAP head: its
        probe queries over the tokens): ``capture(0, probs[B, heads, queries, T])``, the output untouched.

        Raises:
            ViewNotAvailableError: the model pools otherwise (class token, mean) or by a pool vitlens does not read.
        """
        from ..errors import ViewNotAvailableError

        raise ViewNotAvailableError(f"{type(model).__name__} pools without an attention pool (MAP head) vitlens reads, "
                                    "so there is no pool attention to show.")

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        """The module whose input is the heads' outputs side by side, [B, T, heads * head_dim]
        (where head ablation acts), or None when the family has no such module."""
        return None

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """E_pos rows of the patch tokens, [1, gh * gw, D], with the (gh, gw) grid they were learned
        on; None when there is no learned absolute table."""
        raise NotImplementedError

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "it has no learned absolute position embedding"

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> "RelativeBias | None":
        """The learned relative-position bias every block adds to its attention scores, read from the model's own
        modules (``vitlens.families.relative_bias``: timm relpos and BEiT, Hugging Face BEiT); None when it has none."""
        from .relative_bias import read_relative_bias

        return read_relative_bias(model)

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        """Why ``relative_bias`` is None, in words that finish "... is not available for NAME: "."""
        reason = "it adds no learned relative-position bias to its attention scores"
        return reason + ("; its position is a learned absolute table (the position view shows it)"
                         if spec.has_pos_embed else "")

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        """Token grid for another input size (models that accept one)."""
        if tuple(input_hw) == spec.image_size:
            return spec.grid
        sy, sx = spec.stride_px
        return input_hw[0] // sy, input_hw[1] // sx

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        """Preprocessing: input_size, interpolation, mean, std, crop_pct, crop_mode (timm's keys)."""
        raise NotImplementedError

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The classifier output (or features) of a preprocessed batch."""
        return model(x)


class Adapter(Family):
    """A family that reads a model through the family of a module inside it (an OpenCLIP tower's timm trunk).

    Every ``Family`` method that takes the model (``ADAPTED``) and that the adapter does not define itself is
    the inner family's, called on the inner module: an adapter writes only what it changes (its spec's name,
    preprocessing, output), and what the inner family can do (``abilities``: capture by query rows, ...)
    is what the adapter can do.
    """

    def inner(self, model: nn.Module) -> tuple[nn.Module, Family]:
        """(the inner module, its family)."""
        raise NotImplementedError


def _adapted(name: str) -> Callable[..., Any]:
    def method(self: Adapter, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inner_model, inner = self.inner(model)
        return getattr(inner, name)(inner_model, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The inner family's ``{name}``, on the inner module (``Adapter``)."
    return method


#: the ``Family`` methods an ``Adapter`` hands to the inner family: every public one whose first argument is
#: the model, except the two that decide whether the adapter reads the model at all (derived, not listed)
ADAPTED = tuple(name for name, fn in vars(Family).items()
                if inspect.isfunction(fn) and not name.startswith("_") and name not in ("matches", "check")
                and list(inspect.signature(fn).parameters)[1:2] == ["model"])
for _name in ADAPTED:
    setattr(Adapter, _name, _adapted(_name))
del _name


def prefix_labels(cls: bool, distillation: bool = False, registers: int = 0) -> tuple[str, ...]:
    """The prefix tokens in sequence order: class, distillation, then registers."""
    return tuple((["class"] if cls else []) + (["distillation"] if distillation else [])
                 + [f"register {i + 1}" for i in range(registers)])


FAMILIES: list[Family] = []


class AttentionClassUnknown(UnsupportedModelError):
    """A family's refusal of an attention class it does not name, in a model it otherwise reads: ``family_of``
    then tries the fallback families (the generic call-level capture, ``vitlens.families.generic``) before it
    raises this refusal."""


def refuse_other_size(name: str, family: str, built: Sequence[int], input_size: Sequence[int] | None) -> None:
    """For a family that reads a model only at the size it was built for: refuse another ``input_size``
    (what ``Family.spec`` is given from a data config), rather than describe the model at a size it is not fed."""
    if input_size is not None and tuple(int(s) for s in input_size) != tuple(int(s) for s in built):
        raise UnsupportedModelError(
            f"{name!r} is built for {built[0]}x{built[1]} inputs and vitlens reads {family} models at that size only; "
            f"got input_size {tuple(input_size)} in the data config: drop it, or build the model at that size.")


def register(family: Family) -> Family:
    """Add ``family`` to ``FAMILIES``, the one list ``family_of`` reads (in order: the first that matches wins).

    Args:
        family: the family to add.

    Returns:
        ``family``, so that ``register(MyFamily())`` can be a module-level statement.
    """
    FAMILIES.append(family)
    return family


#: timm model modules vitlens refuses, with what it would silently get wrong (before the fallback families are
#: tried: these models have a patch embedding and blocks with ``attn`` too, but no one global attention per block).
REFUSED_FAMILIES = {
    "naflexvit": "variable-resolution patch packing with attention masks and RoPE (NaFlexViT)",
    "xcit": "cross-covariance attention over channels (XCiT)",
    "efficientvit_mit": "ReLU linear attention (EfficientViT, MIT: no softmax over tokens, and no definition of its "
                        "views is written down)",
    "efficientvit_msra": "cascaded group attention over split features with a depthwise convolution on the queries "
                         "(EfficientViT, MSRA)",
    "fastvit": "RepMixer's convolutional token mixing (FastViT: no attention in most stages; the global attention of "
               "fastvit_sa*/ma*'s last stage is read by no family)",
}


def family_of(model: nn.Module, name: str | None = None) -> Family:
    """The family that can capture ``model`` exactly (after its ``check``).

    Args:
        model: the model module.
        name: its name, for messages (default: its class name).

    Returns:
        The ``Family`` that reads it.

    Raises:
        UnsupportedModelError: no family knows the model, or its family refuses it (and says why).
    """
    name = name or type(model).__name__
    refusal: AttentionClassUnknown | None = None
    for family in FAMILIES:
        if family.fallback or not family.matches(model):
            continue
        try:
            family.check(model, name)
            return family
        except AttentionClassUnknown as err:  # the rest of the model is read: a fallback may read its attention
            refusal = err
            break
    module = type(model).__module__
    short = module.rsplit(".", 1)[-1]
    if refusal is None and module.startswith("timm.") and short in REFUSED_FAMILIES:
        raise UnsupportedModelError(
            f"{name!r} ({type(model).__name__}) uses {REFUSED_FAMILIES[short]}, which vitlens does not reproduce "
            f"exactly, so its attention maps are refused rather than shown wrong. Supported: {supported_families()}.")
    for family in FAMILIES:
        if family.fallback and family.matches(model):
            family.check(model, name)
            return family
    if refusal is not None:
        raise refusal
    raise UnsupportedModelError(
        f"{name!r} is not a Vision Transformer vitlens can read (it is a {type(model).__name__} from {module}). "
        f"vitlens reads {supported_families()}: try e.g. 'vit_base_patch16_224', 'deit_small_patch16_224', "
        "'vit_base_r50_s16_224' or the embedded 'ref-vit'.")


def supported_families() -> str:
    """What vitlens reads, family by family in the registry's order (``FAMILIES``), as every "Supported: ..." of a
    refusal says it: a family registered is named there and none other is.

    Returns:
        Each family's ``summary`` (its name where it gives none), joined by "; ".
    """
    return "; ".join(family.summary or family.name for family in FAMILIES)
