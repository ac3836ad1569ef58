"""The app's access token checked by its server (issue 62, items 8 and 9): with ``VITLENS_APP_TOKEN`` set, a local
client without the token gets nothing of any endpoint Streamlit serves (uploads, the websocket that carries every
message, metrics, media, the page), and the token leaves the address once the server has traded it for its cookie.
The suite's app server (conftest's ``app_server``) runs with a token, as a user on a shared machine starts it."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from streamlit.testing.v1 import AppTest

from test_app import APP, NO_BROWSER, SUITE_TOKEN
from vitlens_app import gate

#: Streamlit's endpoints the attacks of issue 62 item 8 used, and the others it serves
ENDPOINTS = [("PUT", "/_stcore/upload_file/0123/4567"), ("GET", "/_stcore/metrics"), ("GET", "/_stcore/host-config"),
             ("GET", "/media/0123.png"), ("GET", "/"), ("GET", "/static/js/index.js"), ("GET", "/?token=wrong")]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # the 303 itself is what the tests look at
        return None


def _request(port: int, method: str, path: str, cookie: str = "", body: bytes | None = None) -> tuple[int, bytes, dict]:
    """(status, body, headers) of one request to the app server, redirects not followed."""
    headers = {"Cookie": cookie} if cookie else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers)
    try:
        with urllib.request.build_opener(_NoRedirect).open(req, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _websocket_opens(port: int, cookie: str = "") -> bool:
    """Whether Streamlit's message websocket (``clear_cache``, reruns, widget values all travel on it) accepts a
    client that sets its own Origin, as a local script can."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    headers = {"Origin": f"http://127.0.0.1:{port}", **({"Cookie": cookie} if cookie else {})}
    try:
        with connect(f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=["streamlit"],
                     additional_headers=headers, open_timeout=30):
            return True
    except InvalidStatus:
        return False


def test_without_the_token_no_endpoint_of_the_server_answers(app_server):
    """Item 8: a local client without the token could PUT uploads (6 x 150 MB accepted), open the websocket and send
    ``clear_cache`` (every session's caches dropped) and read ``/_stcore/metrics``. Now every endpoint answers 403
    with what to do, before Streamlit sees the request (the upload's body is not read), and the websocket is refused
    before it opens; only the liveness probe answers ("ok")."""
    answers = {path: _request(app_server, method, path, body=b"x" * 4096 if method == "PUT" else None)[:2]
               for method, path in ENDPOINTS}
    assert answers == {path: (403, gate.REFUSAL.encode()) for _, path in ENDPOINTS}
    forged = f"{gate.COOKIE}={'0' * 64}; _streamlit_xsrf=2|00|00|00"  # a cookie made up, the XSRF pair set by hand
    assert _request(app_server, "GET", "/_stcore/metrics", cookie=forged)[0] == 403
    assert (_websocket_opens(app_server), _websocket_opens(app_server, cookie=forged)) == (False, False)
    assert _request(app_server, "GET", "/_stcore/health")[:2] == (200, b"ok")


def test_the_tokens_address_hands_out_the_cookie_and_the_cookie_opens_the_app(app_server):
    """The address with the token gets a 303 to itself without the token, on this server, with the access cookie
    (HttpOnly, SameSite=Strict, a value derived from the token, not the token); that cookie opens every endpoint and
    the websocket (the app works for its user). Only a GET trades the token."""
    status, _, headers = _request(app_server, "GET", f"/?view=x&token={SUITE_TOKEN}")
    assert status == 303 and headers["location"] == "/?view=x"
    cookie, *flags = [part.strip() for part in headers["set-cookie"].split(";")]
    assert cookie == f"{gate.COOKIE}={gate.cookie_value(SUITE_TOKEN)}" and SUITE_TOKEN not in cookie
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(flags)
    assert _request(app_server, "GET", "/_stcore/metrics", cookie=cookie)[0] == 200
    assert _request(app_server, "GET", "/", cookie=cookie)[0] == 200
    assert _websocket_opens(app_server, cookie=cookie)
    assert _request(app_server, "GET", f"//evil.example/x?token={SUITE_TOKEN}")[2]["location"] == "/evil.example/x"
    status, body, _ = _request(app_server, "PUT", f"/_stcore/upload_file/0123/4567?token={SUITE_TOKEN}", body=b"x")
    assert (status, body.decode()) == (403, gate.REFUSAL)  # the token is traded for the cookie by a page's GET only


@pytest.mark.skipif(NO_BROWSER, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_token_leaves_the_address_bar_and_the_tabs_history_in_chromium(browser_app):
    """Item 9: ``?token=`` stayed in the address bar and the browser's history after the page opened. Opened with
    it, the app runs and the address is the page's without the token, which is in no entry of the tab's history; a
    tab of another browser context (no cookie) at the bare address reads the refusal and nothing else."""
    browser, url = browser_app
    context = browser.new_context(viewport={"width": 1400, "height": 1600})
    try:
        page = context.new_page()
        page.goto(url, wait_until="domcontentloaded")
        page.get_by_text("Top-5 predictions").wait_for(timeout=90000)
        assert "token" not in page.url and page.url == url.split("?")[0]
        assert "token" not in page.evaluate("location.href")
        page.go_back()  # the entry before the app's is the new tab's blank page, not the address with the token
        assert page.url == "about:blank"
    finally:
        context.close()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(url.split("?")[0], wait_until="domcontentloaded")
        assert page.locator("body").inner_text().strip() == gate.REFUSAL
    finally:
        context.close()


def test_a_token_under_a_server_without_the_gate_runs_nothing(monkeypatch):
    """``streamlit run app.py`` has no gate: with a token set the page says how to start the app behind it and runs
    nothing (no model, no path box, no upload); behind the gate, a session whose websocket came without the cookie
    (none can, the gate refuses it first) is refused too."""
    monkeypatch.setenv(gate.TOKEN_ENV, "s3cret-token")
    for serving in (False, True):
        monkeypatch.setattr(gate, "_serving", serving)
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params["token"] = "s3cret-token"  # the address no longer grants anything: the server's cookie does
        at.run()
        said = [e.value for e in at.error]
        assert not at.exception and len(said) == 1
        assert ("serve.py" in said[0] and "does not check it" in said[0]) if not serving else said[0] == gate.REFUSAL
        assert not at.text_input and not at.selectbox and not at.get("file_uploader") and not at.radio
