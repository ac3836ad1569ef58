"""The registry of families (``FAMILIES``, ``register``) and the one lookup every reader goes through
(``family_of``), with the refusals by name that come before the fallback families (``vitlens.families.base``
re-exports them)."""
from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from ..errors import UnsupportedModelError
from .family import Family


FAMILIES: list[Family] = []


class AttentionClassUnknown(UnsupportedModelError):
    """A family's refusal of an attention class it does not name, in a model it otherwise reads: ``family_of``
    then tries the fallback families (the generic call-level capture, ``vitlens.families.generic``) before it
    raises this refusal, or the one its ``diagnose`` writes naming what the model's attention is (windows, several
    softmaxes, no softmax: ``common.diagnose``), computed only then (it may run a forward)."""

    def __init__(self, message: str, diagnose: Callable[[], str | None] | None = None) -> None:
        super().__init__(message)
        self.diagnose = diagnose


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
        better = refusal.diagnose() if refusal.diagnose is not None else None
        if better:
            raise AttentionClassUnknown(better) from refusal
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
