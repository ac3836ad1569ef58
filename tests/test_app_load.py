"""The app under several users, what is cheap to check (issue 23 section 4): models are cached once for
all sessions, every cache of results has a bound, and the heavy lock's log names each session.
The measurement with several browsers is analyses/app_load.py, not a test."""
from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

import vitlens as vl
from vitlens.loading import seeded
from vitlens_app.fair_lock import lock_fairness, read_lock_log

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
CACHES = ROOT / "vitlens_app" / "caches.py"  # every cached function of the app


@pytest.fixture()
def fresh_caches():
    """The app's caches emptied before and after: models and the lock made again under the test's patches,
    and never left behind for later tests (even when the test fails)."""
    st.cache_resource.clear()
    st.cache_data.clear()
    yield
    st.cache_resource.clear()
    st.cache_data.clear()


def load_script():
    spec = importlib.util.spec_from_file_location("app_load", ROOT / "analyses" / "app_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cached_functions_reads_decorators_and_their_bounds(tmp_path):
    source = tmp_path / "toy_app.py"
    source.write_text(
        "import streamlit as st\n"
        "@st.cache_resource\ndef lock(): ...\n"
        "@st.cache_resource(max_entries=2, show_spinner='x')\ndef model(name): ...\n"
        "@st.cache_data(show_spinner=False)\ndef unbounded(x): ...\n"
        "@st.cache_data(max_entries=8)\ndef result(x): ...\n"
        "def plain(x): ...\n")
    assert load_script().cached_functions(source) == {
        "lock": {"kind": "cache_resource", "max_entries": None},
        "model": {"kind": "cache_resource", "max_entries": 2},
        "unbounded": {"kind": "cache_data", "max_entries": None},
        "result": {"kind": "cache_data", "max_entries": 8}}


def test_every_cache_of_the_app_but_the_lock_is_bounded():
    funcs = load_script().cached_functions(CACHES)
    text = "".join(p.read_text() for p in [APP, *sorted((ROOT / "vitlens_app").rglob("*.py"))])
    assert len(funcs) == text.count("@st.cache_data") + text.count("@st.cache_resource")  # none missed, none elsewhere
    assert [f for f, info in funcs.items() if info["max_entries"] is None] == ["heavy_lock"]  # one lock, no args
    assert funcs["load_model"] == {"kind": "cache_resource", "max_entries": 2}  # the embedded pair, side by side
    assert funcs["position_result"]["max_entries"] == 4


def test_a_position_result_grows_as_the_square_of_the_patches():
    """The comment over position_result: (gh * gw)^2 float64 similarities, 128 MB at 64 x 64."""
    m = vl.load_model("ref-vit", device="cpu")
    size = {g: len(pickle.dumps(vl.position_similarity(m, grid=(g, g)), protocol=pickle.HIGHEST_PROTOCOL))
            for g in (8, 16)}
    assert size[16] == pytest.approx(256 ** 2 * 8, rel=0.02) and size[8] == pytest.approx(64 ** 2 * 8, rel=0.1)
    assert 64 ** 4 * 8 / 2 ** 20 == 128


def test_a_second_session_reuses_the_models_and_the_lock_names_each_session(monkeypatch, tmp_path, fresh_caches):
    calls: list[str] = []
    load = vl.load_model
    # the app loads through load_model_seeded, which calls vitlens.loading.seeded's load_model
    monkeypatch.setattr(seeded, "load_model", lambda name, *a, **k: calls.append(name) or load(name, *a, **k))
    monkeypatch.setenv("VITLENS_LOCK_LOG", str(tmp_path / "lock.jsonl"))  # the lock is made again under it
    sessions = [AppTest.from_file(str(APP), default_timeout=120) for _ in range(2)]
    for at in sessions:
        at.run()
    for at in sessions:
        at.selectbox(key="m1-ref").set_value("ref-hybrid").run()
        assert not at.exception and not at.error
    assert calls == ["ref-vit", "ref-hybrid"]  # once for both sessions
    records = read_lock_log(tmp_path / "lock.jsonl")
    assert [r["what"] for r in records].count("load_model") == 2  # each model's load held the lock once
    assert records[0]["owner"] != "MainThread"  # named by the session, not the thread
    assert all(v["fair"] for v in lock_fairness(records).values())


def test_every_forward_of_a_shared_model_runs_under_the_heavy_lock(monkeypatch, fresh_caches):
    """Two sessions share one cached model; the views' capture hooks it, so a forward by another session in
    between would feed that session's attention into the capture (the load test met "Blocks saw different
    numbers of images" from the Top-5 predictions' forward). Every forward, in every view, holds the lock."""
    import threading
    import traceback

    from vitlens_app import fair_lock

    locks: list = []
    make = fair_lock.FairLock.__init__

    def register(self, *a, **k):
        make(self, *a, **k)
        locks.append(self)

    unlocked: list[str] = []
    forwards: list[str] = []

    def check(module, _inputs):
        forwards.append(type(module).__name__)
        if not any(lock._holder == threading.get_ident() for lock in locks):
            unlocked.append("".join(traceback.format_stack(limit=12)))

    load = vl.load_model

    def hooked(*a, **k):
        m = load(*a, **k)
        m.model.register_forward_pre_hook(check)
        return m

    monkeypatch.setattr(fair_lock.FairLock, "__init__", register)
    monkeypatch.setattr(seeded, "load_model", hooked)  # fresh_caches: no result cached before skips its forward
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.run()
    at.session_state["n-cmp"] = 4  # CKA's fewest images: a short Compare
    for view in ["Attention distance", "Attention maps", "Attributions", "Compare"]:
        at.radio(key="view").set_value(view).run()
        assert not at.exception and not at.error, view
    assert len(forwards) > 10 and len(locks) == 1
    assert unlocked == [], unlocked[0]
