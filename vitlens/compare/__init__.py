"""Comparisons deeper than attention distance (Raghu et al. 2021 asked them of ViTs and CNNs):

- ``cka``: how similar two models' representations are, layer by layer (minibatch linear CKA);
- ``heads``: which heads matter (one head removed at a time).

The third question, which tokens soak up attention, is an attention view:
``vitlens.views.prefix``.
"""
from __future__ import annotations

from .cka import CKAResult, MinibatchCKA, cka, hsic
from .heads import HeadImportanceResult, head_importance

__all__ = ["CKAResult", "HeadImportanceResult", "MinibatchCKA", "cka", "head_importance", "hsic"]
