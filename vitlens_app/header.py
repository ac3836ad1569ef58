"""The top of the page, above every view: the model (loaded, its facts in the sidebar), the current image as the
model sees it and its predictions; and the access check that comes before everything."""
from __future__ import annotations

import numpy as np
import streamlit as st

from vitlens_app.caches import load_model, predictions_result
from vitlens_app.context import Context, show_error
from vitlens_app.gate import REFUSAL, TOKEN_ENV, app_token, cookie_grants, gate_serving
from vitlens_app.library import format_probability
from vitlens_app.sidebar import show_facts


def access_granted() -> bool:
    """Whether this session may use the app: no token set (``$VITLENS_APP_TOKEN``), or this process's server checks
    the token on every request (``vitlens_app.gate.TokenGate``, ``streamlit run serve.py``) and this session's
    websocket came with the cookie the token's address hands out. A token set under a server without the gate
    (``streamlit run app.py``) is refused: the page alone would leave uploads, messages and metrics open."""
    token = app_token()
    if not token:
        return True
    return gate_serving() and cookie_grants(dict(st.context.cookies), token)


def access_refusal() -> str:
    """What a page without access reads: how to start the app behind its gate, or how to open it."""
    if not gate_serving():
        return (f"{TOKEN_ENV} is set but this server does not check it: start the app with `bash scripts/app.sh` or "
                "`streamlit run serve.py`, which check the token on every request.")
    return REFUSAL


def image_box_key(ikey: str) -> str:
    """The "Current image" box's widget key for one image set."""
    return f"img-idx-{ikey}"


def model_and_image(picked: tuple | None, images: list, names: list[str], ikey: str, masks: np.ndarray | None,
                    labels: np.ndarray | None, image_source: str) -> Context:
    """The model's facts, the current image and its predictions; stops the run with a message when
    there is no model or no image to show."""
    if picked is None:  # the sidebar's box says what it wants; the page says where to look
        st.info("No model to show yet: give one in the sidebar (under Model, the box says what it needs).")
        st.stop()
    try:
        m = load_model(*picked)
    except Exception as e:  # noqa: BLE001 - every failure becomes a message
        show_error(e)
        st.stop()
    show_facts(m)
    if not images:
        st.info("Upload at least one image, or pick sample photos or shapes in the sidebar.")
        st.stop()
    # keyed by the image set: a new set is a new box, so the name shown is always the image shown (one key
    # across sets kept the old set's label in the browser over the new set's image)
    idx = st.selectbox("Current image", range(len(images)), format_func=lambda i: names[i],
                       key=image_box_key(ikey))
    idx = min(idx, len(images) - 1)
    try:
        x = m.preprocess([images[idx]])
        ctx = Context(m=m, mkey=f"{picked}", images=images, names=names, ikey=ikey, masks=masks, labels=labels,
                      index=idx, shown=m.display(x)[0])
        preds = predictions_result(m, ctx.mkey, x, ctx.cur_key)
    except Exception as e:  # noqa: BLE001
        show_error(e)
        st.stop()
    caveat = m.prediction_caveat(image_source)
    if caveat:
        st.caption(caveat)
    top = st.columns([1, 2])
    top[0].image(ctx.shown, caption=f"{names[idx]} as the model sees it ({ctx.shown.shape[1]}x{ctx.shown.shape[0]})",
                 width=220)
    show_predictions(top[1], preds, "Top-5 predictions")
    return ctx


def show_predictions(column: object, preds: list, title: str) -> None:
    """The top-5 table under ``title`` in ``column``, or, for a model without a classifier head, why there is none
    (the image's and the clip's header)."""
    if preds:
        column.markdown(f"**{title}**")
        column.table([{"class": label, "probability": format_probability(p)} for label, p in preds])
    else:
        column.info("This model has no classifier head (a feature model): no predictions to show.")
