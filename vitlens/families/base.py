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

The interface lives in modules of one concept each, re-exported here (the import path every family uses):
``capture_request`` (``CaptureRequest``, ``CaptureAbilities``), ``hook_session`` (``Handles``, ``HookSession``),
``locks`` (``SharedLock``, ``model_lock``), ``family`` (``Family``, ``Adapter``) and ``registry`` (``FAMILIES``,
``register``, ``family_of``).
"""
from __future__ import annotations

from .capture_request import CaptureAbilities, CaptureRequest, Emit
from .family import ADAPTED, Adapter, Family, prefix_labels
from .hook_session import Handles, HookSession
from .locks import SharedLock, model_lock, shared_parts
from .registry import (FAMILIES, REFUSED_FAMILIES, AttentionClassUnknown, family_of, refuse_other_size, register,
                       supported_families)

__all__ = ["ADAPTED", "FAMILIES", "REFUSED_FAMILIES", "Adapter", "AttentionClassUnknown", "CaptureAbilities",
           "CaptureRequest", "Emit", "Family", "Handles", "HookSession", "SharedLock", "family_of", "model_lock",
           "prefix_labels", "refuse_other_size", "register", "shared_parts", "supported_families"]
