"""Exceptions raised by vitlens. Every message says what was wrong and what to do about it, in the
words of the interface the user is in: a Python call, the command line or the app.

An error built with ``fixes={"python": ..., "cli": ..., "app": ...}`` reads with the Python
hint by default (``str(e)``); the command line and the app ask for theirs with
``e.message_for("cli")`` / ``e.message_for("app")``.
"""
from __future__ import annotations

#: the interfaces a hint is written for: the only keys ``fixes`` and ``message_for`` take
INTERFACES = ("python", "cli", "app")


def _check_interfaces(names) -> None:
    bad = [n for n in names if n not in INTERFACES]
    if bad:  # a mistyped key would be a hint silently never shown
        raise ValueError(f"interface must be one of {', '.join(INTERFACES)}; got {', '.join(map(repr, bad))}.")


class VitlensError(Exception):
    """Base class of every error vitlens raises on purpose."""

    def __init__(self, message: str, fixes: dict[str, str] | None = None) -> None:
        self.message = message
        self.fixes = dict(fixes or {})
        _check_interfaces(self.fixes)
        super().__init__(self.message_for("python"))

    def message_for(self, interface: str = "python") -> str:
        """The message with the hint for ``interface`` ("python", "cli" or "app"), when there is one."""
        _check_interfaces([interface])
        fix = self.fixes.get(interface) or self.fixes.get("python")
        return f"{self.message} {fix}" if fix else self.message

    def __reduce__(self):  # keep the hints when the error crosses a process boundary (Ray workers)
        return (type(self), (self.message, self.fixes))


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


class ClipLoadError(VitlensError, ValueError):
    """A video, animated GIF or folder of frames that cannot be read as a clip (or not within the limits)."""


class ViewNotAvailableError(VitlensError, ValueError):
    """A view that does not exist for this model (e.g. position similarity without E_pos)."""


class InvalidParameterError(VitlensError, ValueError):
    """A parameter outside its accepted values."""


class DeviceUnavailableError(VitlensError, RuntimeError):
    """A device that this machine does not have (e.g. CUDA without a GPU)."""
