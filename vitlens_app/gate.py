"""The app's access token, checked by its server: with ``$VITLENS_APP_TOKEN`` set, every request Streamlit serves
(the page, its scripts, the websocket that carries every message, uploads, media, metrics) must carry a cookie that
only the address with the token hands out, so a local client without the token gets nothing of the app
(docs/security.md, "Other users of the same machine").

The browser opens ``/?token=TOKEN`` once: the gate compares it in constant time, sets the cookie (HttpOnly,
SameSite=Strict, for this session of the browser) and redirects to the same address without the token, so it leaves
the address bar and the tab's history. The cookie holds a value derived from the token, not the token itself.

The gate is ASGI middleware of Streamlit's own server (``st.App(..., middleware=...)``, see ``serve.py``):
``streamlit run app.py`` alone has no gate, and the page then refuses to run while a token is set
(``vitlens_app.header.access_granted``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

#: a secret the server asks for in the page's address (``?token=...``) when set: on a shared machine, where every
#: local user can reach 127.0.0.1, the app is then its user's alone (docs/security.md)
TOKEN_ENV = "VITLENS_APP_TOKEN"
#: the cookie the gate sets once the address's token matched
COOKIE = "vitlens_app_access"
#: the one path served without the token: Streamlit's liveness probe, which answers "ok" and nothing else
OPEN_PATHS = frozenset({"/_stcore/health"})
#: what a client without the token reads (HTTP 403)
REFUSAL = ("This vitlens app asks for its access token: open it as http://127.0.0.1:8501/?token=TOKEN, with the "
           f"token it was started with ({TOKEN_ENV}).")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: set when a ``TokenGate`` wraps this process's server: the page checks it (a token with no gate is refused)
_serving = False


def app_token() -> str:
    """The token this process was started with, or "" when none is set."""
    return os.environ.get(TOKEN_ENV, "")


def cookie_value(token: str) -> str:
    """The cookie's value for ``token``: derived from it (a cookie jar read elsewhere does not show the token)."""
    return hmac.new(token.encode(), b"vitlens-app-cookie", hashlib.sha256).hexdigest()


def gate_serving() -> bool:
    """Whether this process's Streamlit server checks the token on every request (``TokenGate`` installed)."""
    return _serving


def cookie_grants(cookies: MutableMapping[str, str] | dict[str, str], token: str) -> bool:
    """Whether ``cookies`` (a request's) carry the access cookie of ``token`` (compared in constant time)."""
    given = str(cookies.get(COOKIE, ""))
    return bool(token) and hmac.compare_digest(given.encode(), cookie_value(token).encode())


def _request_cookies(scope: Scope) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    for name, value in scope.get("headers", []):
        if name == b"cookie":
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # noqa: BLE001 - a malformed cookie header grants nothing
                return {}
    return {k: m.value for k, m in jar.items()}


class TokenGate:
    """ASGI middleware: requests without the access cookie get HTTP 403 (a websocket is closed before it opens);
    the address with the right ``token`` (a GET) gets the cookie and a redirect to itself without the token, on this
    server. With no token
    set it passes everything through (the app is then for a machine of one's own, docs/security.md)."""

    def __init__(self, app: ASGIApp) -> None:
        global _serving
        self.app = app
        _serving = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = app_token()
        if scope["type"] not in ("http", "websocket") or not token or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if cookie_grants(_request_cookies(scope), token):
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == "token"]
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and given and \
                hmac.compare_digest(given[-1].encode(), token.encode()):
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            # one leading slash: "//host/..." would send the browser to another host
            path = "/" + (scope.get("root_path", "") + scope.get("path", "/")).lstrip("/")
            where = path + (f"?{rest}" if rest else "")
            await send({"type": "http.response.start", "status": 303, "headers": [
                (b"location", where.encode("latin-1")),
                (b"set-cookie", f"{COOKIE}={cookie_value(token)}; Path=/; HttpOnly; SameSite=Strict".encode()),
                (b"cache-control", b"no-store"), (b"referrer-policy", b"no-referrer"),
                (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = REFUSAL.encode()
        await send({"type": "http.response.start", "status": 403, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": body})
