"""The vitlens app behind its server-side token gate: ``streamlit run serve.py`` (what ``bash scripts/app.sh`` runs).

Streamlit serves ``app.py`` as ``streamlit run app.py`` does, with one more middleware in front of every endpoint:
with ``$VITLENS_APP_TOKEN`` set, a request without the access cookie the token's address hands out gets nothing
(``vitlens_app.gate``; docs/security.md). Without a token set it is the plain app.
"""
from __future__ import annotations

import streamlit as st
from starlette.middleware import Middleware

from vitlens_app.gate import TokenGate

app = st.App("app.py", middleware=[Middleware(TokenGate)])
