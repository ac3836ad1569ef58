"""The engine every attention view runs on, below the views (Fig. 6/14 rollout, Fig. 7 right and Fig. 11
attention distance are its consumers; attribution, compare and the survey use it too):

- ``capture``: exact post-softmax attention of every block (side or inline), through the model's family;
- ``plan``: ``capture_plan``, the one place that decides how a stream captures (mode, query rows, budget);
- ``consumer``: the consumer protocol (``AttentionConsumer``, ``BatchInfo``, ``query_rows``);
- ``stream``: ``stream_attention``, images through the model once, every consumer fed from that pass;
- ``sites``: the named sites (``blocks.3.hook_resid_pre``) every analysis beside attention reads, through
  ``SiteSession``.
"""
from __future__ import annotations

from .capture import AttentionCapture, capture_attention
from .consumer import AttentionConsumer, BatchInfo, query_rows
from .plan import CAPTURE_MODES, CapturePlan, capture_plan
from .stream import stream_attention

__all__ = ["AttentionCapture", "AttentionConsumer", "BatchInfo", "CAPTURE_MODES", "CapturePlan", "capture_attention",
           "capture_plan", "query_rows", "stream_attention"]
