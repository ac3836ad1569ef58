"""Loading models and describing them: names to weights (embedded pair, timm hub, local
checkpoints, user modules), the spec every view reads, and the presets a user can pick."""
from __future__ import annotations

from ..families import REFUSED_FAMILIES, family_of
from .model import LoadedModel, resolve_device
from .presets import PRESETS, Preset, list_models
from .resolve import load_model, loadable, suggest
from ..core.spec import ModelSpec, param_count_str

__all__ = ["LoadedModel", "ModelSpec", "PRESETS", "Preset", "REFUSED_FAMILIES", "family_of", "list_models",
           "load_model", "loadable", "param_count_str", "resolve_device", "suggest"]
