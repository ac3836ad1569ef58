"""The embedded reference pair and everything it is made of: procedural shape scenes with object
masks (``shapes``), the two model definitions (``models``), the training recipes (``training``)
and the committed weights (``weights/``).

The pair lets every view of the paper (Fig. 6, 7, 11) show learned structure offline.
"""
from __future__ import annotations

from .models import EMBED_DIM, REFERENCE_NAMES, WEIGHTS_DIR, SmallResNet, build_reference, weights_path
from .shapes import CLASSES, HELD_OUT_SEED, IMAGE_SIZE, ShapesBatch, generate

__all__ = ["CLASSES", "EMBED_DIM", "HELD_OUT_SEED", "IMAGE_SIZE", "REFERENCE_NAMES", "ShapesBatch", "SmallResNet",
           "WEIGHTS_DIR", "build_reference", "generate", "weights_path"]
