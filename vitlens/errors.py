"""Exceptions raised by vitlens. Every message says what was wrong and what to do about it."""
from __future__ import annotations


class VitlensError(Exception):
    """Base class of every error vitlens raises on purpose."""


class UnknownModelError(VitlensError, ValueError):
    """A model name that is neither a reference model, a timm model nor an existing file."""


class UnsupportedModelError(VitlensError, ValueError):
    """A model vitlens cannot analyse exactly (not a ViT, or an attention variant it refuses)."""


class WeightsUnavailableError(VitlensError, OSError):
    """Pretrained weights that are neither cached nor downloadable (e.g. no network)."""


class CheckpointError(VitlensError, ValueError):
    """A checkpoint file that cannot be read safely or does not fit the architecture."""


class ImageLoadError(VitlensError, ValueError):
    """An image that cannot be read or converted to RGB."""


class ViewNotAvailableError(VitlensError, ValueError):
    """A view that does not exist for this model (e.g. position similarity without E_pos)."""


class InvalidParameterError(VitlensError, ValueError):
    """A parameter outside its accepted values."""
