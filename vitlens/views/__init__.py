"""The views of the ViT paper (section 4.5, appendix D.7-D.8), consumers of the engine below them
(``vitlens.engine``: exact capture, the plan, the stream and the consumer protocol).

- ``distance`` (Fig. 7 right, Fig. 11) and ``rollout`` (Fig. 6): the attention consumers;
- ``filters`` (Fig. 7 left) and ``position`` (Fig. 7 centre): the weight-only views, and ``relpos``, the position
  view of relative-position models (their learned bias by query-to-key offset);
- ``attention_maps``: one image's attention, head by head, for one query token;
- ``analyze``: the views as one call each, and all four from one pass;
- ``prefix``: attention parked on prefix tokens, and token norms;
- ``registry``: the one list of views.

Every view returns a result object of numpy arrays (``vitlens.results``); figures are drawn
from results by ``vitlens.figures``.
"""
from __future__ import annotations

from . import analyze, attention_maps, distance, filters, position, prefix, relpos, rollout  # noqa: F401
