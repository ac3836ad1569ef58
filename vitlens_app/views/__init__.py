"""The app's pages, one module per view, and ``pages()``: the view selector's choices and what each renders.

A page is a function of a ``Context`` (``vitlens_app.context``). The library's views come first, by their
registry labels (``vitlens.views.registry``), then the app's own pages; a registered view without a page
written for it gets the generic one (``registered``).
"""
from __future__ import annotations

from typing import Callable

from vitlens_app.context import Context
from vitlens_app.library import VIEWS
from vitlens_app.views.attributions import render_attributions
from vitlens_app.views.compare import render_compare
from vitlens_app.views.components import render_components
from vitlens_app.views.distance import render_distance
from vitlens_app.views.filters import render_filters
from vitlens_app.views.maps import render_maps
from vitlens_app.views.position import render_position
from vitlens_app.views.registered import render_registered
from vitlens_app.views.sae import render_sae
from vitlens_app.views.survey import render_survey


def pages() -> dict[str, Callable[[Context], None]]:
    """The pages by their selector labels, read from the view registry now (a view registered since the app
    started gets its page on the next run)."""
    out: dict[str, Callable[[Context], None]] = {
        VIEWS["filters"].label: render_filters,
        VIEWS["position"].label: render_position,
        VIEWS["distance"].label: render_distance,  # with the prefix view beside it
        "Attention maps": render_maps,  # one image's maps per head, and its rollout
        "Attributions": render_attributions,
        "Compare": render_compare,
        "Components": render_components,  # the output as a sum of parts, the lens, norms, patching
        "Features (SAE)": render_sae,  # a sparse autoencoder's features, their writers and their ablation
        "Survey": render_survey,
    }
    out.update({v.label or v.name: render_registered(name) for name, v in VIEWS.items()
                if not v.shown_in and (v.label or v.name) not in out})
    return out
