"""The app under several users (issue 23 section 4): N browser sessions at once, every view, both embedded models.

Usage:
    python analyses/app_load.py [--sessions 1 2 4] [--seconds 120] [--out runs/app_load/app_load.json]
        [--survey DIR] [--bound-only] [--no-bound]

For each session count N, a fresh ``streamlit run app.py`` (loopback, its own port, the heavy lock's
log on: ``VITLENS_LOCK_LOG``) and N Chromium pages drive it for ``--seconds``, each session cycling:
for each of ref-vit and ref-hybrid, choose the model, choose a current image (a different scene each
cycle and session, so the per-image views really compute), then click every view in turn; on the
Survey view, open a small survey folder of the pair (made once with ``vl.survey``, reused).

Browsers: one Chromium, one browser context per session. A context has its own cookies and storage
and its own renderer, so each page is a separate Streamlit session over its own websocket: the server
sees what N people's browsers would send. One browser process instead of N keeps the driver's own
CPU and memory small on a 2-core machine. The driver is asyncio (Playwright's async API): the N
sessions really act at the same time.

What one action's latency is: from just before the click until, polled every 50 ms in the page,
(1) the app's script state is ``notRunning`` (``data-test-script-state`` on ``stApp``: Streamlit's
running indicator is off), (2) no element is stale (``data-stale``: Streamlit marks the previous run's
elements until the new run has drawn over them), and (3) a text that only the target's content
shows is in the page (``MARKERS``; for a view, a label or caption drawn after its heavy results, so it
is there only once they are). Cycle 0 of each session pays its own per-session results (attention
distance over 32 scenes and CKA, kept per session); ``warm`` figures leave cycle 0 out.

Exceptions: after every action, Streamlit's exception element (``stException``) and error alerts
(``stAlertContentError``) in the page, JavaScript errors of the page, and lines of the server's
stderr that mention a traceback, an exception or an error.

Memory: the server's resident memory (its process and children, /proc) every 0.25 s: the peak per
N, and how many times a model was loaded (the lock's ``load_model`` holds: once per model means
models are cached once, not per session). ``cache_bound`` (also alone: ``--bound-only``) is what the
app's caches can hold at most: each cached function's ``max_entries`` (read from vitlens_app/caches.py) times its
largest result as Streamlit stores it (pickled), on the embedded pair at the widgets' limits.

Fairness: from the lock's log, per session its longest wait, the longest hold of any other session,
the FIFO bound (one hold of each other session), and ``max_bypass``: the most holds one other
session got during one of its waits (1 or less: nobody starved; ``vitlens_app.fair_lock.lock_fairness``).
The log names Streamlit's session ids; the JSON numbers them in the order of their first request
(not the driver's order). ``lock_contrast`` puts ``threading.Lock`` (the app's lock before) beside
``FairLock`` on threads that compute several times in a row.

A driver failure (a click or a wait that timed out: the session stops, with a screenshot
``stuck-*.png`` beside the JSON) is listed apart from the app's exceptions.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vitlens_app.fair_lock import lock_fairness, read_lock_log  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
MODELS = ["ref-vit", "ref-hybrid"]
VIEWS = ["Filters", "Position embeddings", "Attention distance", "Attention maps", "Attributions", "Compare",
         "Survey"]
# a text only the target's own content shows, drawn after its heavy results (textContent: hidden tabs count)
MARKERS = {
    "Filters": "Explained variance of the top",
    "Position embeddings": "Similarity of patch",
    "Attention distance": "Which heads matter?",  # the expander after the distance figures
    "Attention maps": "One query's attention",  # after the rollout, before the heads
    "Attributions": "Maps and scores (JSON)",  # the download row after the table
    "Compare": "Per-layer table (CSV)",  # the distance tab, drawn after the CKA tab
    "Survey": "Give the folder of a survey",
    "survey-open": "Table (CSV)",  # the survey's table download, after its figures
}
SCENES = 32  # the app opens on 32 held-out scenes
MEMO_ENTRIES = 6  # vitlens_app.caches.remembered(): entries kept per kind and session
SETTLED = """([marker, scope]) => {
    const app = document.querySelector("[data-testid='stApp']");
    if (!app || app.dataset.testScriptState !== "notRunning") return false;
    if (document.querySelector("[data-stale='true']")) return false;
    const root = document.querySelector(scope);
    return !!root && root.textContent.includes(marker);
}"""
PROBLEMS = """() => [...document.querySelectorAll(
    "[data-testid='stException'], [data-testid='stAlertContentError']")].map(e => e.innerText.slice(0, 300))"""
DIAGNOSE = """([marker, scope]) => ({
    state: document.querySelector("[data-testid='stApp']")?.dataset.testScriptState,
    stale: document.querySelectorAll("[data-stale='true']").length,
    connection: document.querySelector("[data-testid='stApp']")?.dataset.testConnectionState,
    marker: !!document.querySelector(scope)?.textContent.includes(marker),
    scope: !!document.querySelector(scope)})"""
CHECKED_VIEW = """() => [...document.querySelectorAll("[data-testid='stRadio']")].filter(r =>
    r.querySelector("[data-testid='stWidgetLabel']")?.innerText.trim() === "View").flatMap(r =>
    [...r.querySelectorAll("input[type=radio]")].filter(i => i.checked).map(i => i.closest("label").innerText.trim()))[0]"""
STDERR_PROBLEM = re.compile(r"Traceback|Exception|Error", re.I)


# ---------------------------------------------------------------- the server and its memory
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(port: int, lock_log: Path, stderr_path: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VITLENS_LOCK_LOG": str(lock_log), "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"),
                               "--server.headless", "true", "--server.address", "127.0.0.1",
                               "--server.port", str(port), "--browser.gatherUsageStats", "false"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(stderr_path, "w"))
    deadline = time.time() + 120
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                return server
        except OSError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"streamlit exited ({server.returncode}); see {stderr_path}")
        if time.time() > deadline:
            server.terminate()
            raise SystemExit("streamlit did not come up in 120 s")
        time.sleep(0.5)


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, in MB (/proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self.samples, self.stop = pid, every_s, [], threading.Event()

    def run(self) -> None:
        t0 = time.time()
        while not self.stop.is_set():
            self.samples.append((time.time() - t0, tree_rss_mb(self.pid)))
            self.stop.wait(self.every_s)


# ---------------------------------------------------------------- one browser session
class Session:
    """One Chromium page driving the app; records each action's latency and every problem seen."""

    def __init__(self, index: int, page: Any, shots: Path | None = None, timeout_s: float = 120) -> None:
        self.index, self.page, self.shots, self.timeout_s = index, page, shots, timeout_s
        self.actions: list[dict] = []
        self.problems: list[str] = []  # what the app showed or threw
        self.failures: list[str] = []  # where the driver itself could not go on
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))

    async def settle(self, marker: str, scope: str = "[data-testid='stApp']", timeout_s: float = 300) -> None:
        await self.page.wait_for_function(SETTLED, arg=[marker, scope], polling=50, timeout=timeout_s * 1000)

    async def act(self, kind: str, name: str, cycle: int, do: Any, marker: str,
                  scope: str = "[data-testid='stApp']") -> None:
        t = time.perf_counter()
        await do()
        try:
            await self.settle(marker, scope, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - say what the page showed instead, then stop this session
            state = await self.page.evaluate(DIAGNOSE, [marker, scope])
            if self.shots is not None:
                await self.page.screenshot(path=str(self.shots / f"stuck-{self.index}-{cycle}-{kind}.png"),
                                           full_page=True)
            raise RuntimeError(f"{kind} {name!r} (cycle {cycle}) never settled in {self.timeout_s:.0f} s: "
                               f"{state}") from e
        dt = time.perf_counter() - t
        shown = await self.page.evaluate(PROBLEMS)
        self.problems += [f"{name}: {s}" for s in shown]
        self.actions.append({"kind": kind, "name": name, "cycle": cycle, "seconds": dt, "end": time.time(),
                             "problems": len(shown)})

    def widget(self, testid: str, label: str) -> Any:
        return self.page.locator(f"[data-testid='{testid}']").filter(
            has=self.page.locator("[data-testid='stWidgetLabel']").get_by_text(label, exact=True))

    async def choose(self, label: str, typed: str, option: str | re.Pattern) -> None:
        """Pick an option of the selectbox labelled ``label``: type ``typed`` into it (its list draws only the
        options in view: scene 15 of 32 is not there to click until the list is filtered), click ``option``."""
        box = self.widget("stSelectbox", label).locator("input")
        await box.click()
        await box.fill(typed)
        await self.page.get_by_role("option", name=option).first.click()

    async def open(self, url: str) -> float:
        t = time.perf_counter()
        await self.page.goto(url, wait_until="domcontentloaded")
        await self.settle("Top-5 predictions")
        return time.perf_counter() - t

    async def cycle(self, c: int, survey: Path, deadline: float) -> None:
        view_radio = self.widget("stRadio", "View")
        for mi, model in enumerate(MODELS):
            if time.time() > deadline:
                return
            current = await self.widget("stSelectbox", "Embedded model").locator("input").input_value()
            if current != model:
                await self.act("model", model, c, lambda: self.choose("Embedded model", model, model),
                               f"{model}.safetensors", "[data-testid='stSidebar']")
            k = (7 * self.index + 2 * c + mi + 1) % SCENES  # a new scene each time, different across sessions
            await self.act("image", f"scene {k}", c,
                           lambda: self.choose("Current image", f"scene {k} (", re.compile(rf"^scene {k} \(")),
                           f"scene {k} (", "[data-testid='stImageCaption']")
            for view in VIEWS:
                if time.time() > deadline:
                    return
                if await self.page.evaluate(CHECKED_VIEW) == view:  # the page opens on Filters: no switch to time
                    continue
                await self.act("view", view, c, lambda: view_radio.get_by_text(view, exact=True).click(),
                               MARKERS[view], "[data-testid='stMain']")
                if view == "Survey":
                    async def fill() -> None:
                        box = self.widget("stTextInput", "Survey folder").locator("input")
                        await box.fill(str(survey))
                        await box.press("Enter")
                    await self.act("survey", "survey-open", c, fill, MARKERS["survey-open"],
                                   "[data-testid='stMain']")


async def drive(url: str, n: int, seconds: float, survey: Path, shots: Path) -> tuple[list[Session], list[float]]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        sessions = []
        for i in range(n):
            context = await browser.new_context(viewport={"width": 1400, "height": 2200})
            sessions.append(Session(i, await context.new_page(), shots))
        opens = await asyncio.gather(*(s.open(url) for s in sessions))  # all at once, as the load itself
        deadline = time.time() + seconds

        async def loop(s: Session) -> None:
            c = 0
            try:
                while time.time() < deadline:
                    await s.cycle(c, survey, deadline)
                    c += 1
            except Exception as e:  # noqa: BLE001 - a driver failure is a finding, recorded with the session
                s.failures.append(f"session {s.index}: {type(e).__name__}: {str(e).splitlines()[0][:500]}")

        await asyncio.gather(*(loop(s) for s in sessions))
        await browser.close()
    return sessions, list(opens)


# ---------------------------------------------------------------- figures
def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]  # nearest rank on the sorted sample


def latency(values: list[float]) -> dict:
    return {"n": len(values), "p50_s": quantile(values, 0.5), "p95_s": quantile(values, 0.95),
            "max_s": max(values) if values else None}


def measure(n: int, seconds: float, survey: Path, work: Path) -> dict:
    port = free_port()
    lock_log, stderr_path = work / f"lock-{n}.jsonl", work / f"stderr-{n}.txt"
    lock_log.unlink(missing_ok=True)
    server = start_app(port, lock_log, stderr_path)
    rss0 = tree_rss_mb(server.pid)
    sampler = RssSampler(server.pid)
    sampler.start()
    try:
        sessions, opens = asyncio.run(drive(f"http://127.0.0.1:{port}/", n, seconds, survey, work))
    finally:
        sampler.stop.set()
        sampler.join()
        server.terminate()
        server.wait(timeout=60)
    stderr = [line for line in stderr_path.read_text().splitlines() if STDERR_PROBLEM.search(line)]
    records = read_lock_log(lock_log) if lock_log.exists() else []
    owners = {}  # the lock names Streamlit session ids; the driver's session of each is the order of first use
    for r in sorted(records, key=lambda r: r["requested"]):
        owners.setdefault(r["owner"], len(owners))
    fair = lock_fairness(records) if records else {}
    views = [a["seconds"] for s in sessions for a in s.actions if a["kind"] == "view"]
    warm = [a["seconds"] for s in sessions for a in s.actions if a["kind"] == "view" and a["cycle"] > 0]
    loads = [r for r in records if r["what"] == "load_model"]
    return {
        "sessions": n, "seconds": seconds, "open_s": opens,
        "switches": len(views), "view_switch": latency(views), "view_switch_warm": latency(warm),
        "per_view": {v: latency([a["seconds"] for s in sessions for a in s.actions if a["name"] == v])
                     for v in VIEWS},
        "other_actions": {k: latency([a["seconds"] for s in sessions for a in s.actions if a["kind"] == k])
                          for k in ("model", "image", "survey")},
        "cycles": [max((a["cycle"] for a in s.actions), default=-1) + 1 for s in sessions],
        "per_session_p95_s": [quantile([a["seconds"] for a in s.actions if a["kind"] == "view"], 0.95)
                              for s in sessions],
        "exceptions": sum(len(s.problems) for s in sessions) + len(stderr),
        "driver_failures": [f for s in sessions for f in s.failures],
        "problems": [p for s in sessions for p in s.problems][:50], "stderr_problems": stderr[:50],
        "rss_mb": {"after_start": rss0, "peak": max((r for _, r in sampler.samples), default=rss0),
                   "end": sampler.samples[-1][1] if sampler.samples else rss0},
        "rss_samples": [(round(t, 2), round(r, 1)) for t, r in sampler.samples[::4]],
        "model_loads": len(loads),
        "actions": [[{k: a[k] for k in ("kind", "name", "cycle", "seconds")} for a in s.actions] for s in sessions],
        "lock": {"holds": len(records), "by_what": {w: sum(r["what"] == w for r in records)
                                                    for w in sorted({r["what"] for r in records})},
                 "per_session": {f"session {owners[o]}": v for o, v in fair.items()},
                 "max_bypass": max((v["max_bypass"] for v in fair.values()), default=0),
                 "fair": all(v["fair"] for v in fair.values())},
    }


# ---------------------------------------------------------------- what the caches can hold
def cached_functions(app: Path = ROOT / "vitlens_app" / "caches.py") -> dict[str, dict]:
    """Every function the app caches (all in its caches module): {name: {"kind": "cache_data" | "cache_resource", "max_entries": int | None}}."""
    out = {}
    for node in ast.walk(ast.parse(app.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        for d in node.decorator_list:
            call = d if isinstance(d, ast.Call) else None
            target = call.func if call else d
            if isinstance(target, ast.Attribute) and target.attr in ("cache_data", "cache_resource"):
                kw = {k.arg: k.value for k in (call.keywords if call else [])}
                entries = kw.get("max_entries")
                out[node.name] = {"kind": target.attr,
                                  "max_entries": entries.value if isinstance(entries, ast.Constant) else None}
    return out


def pickled_mb(obj: Any) -> float:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) / 2**20


def cache_bound() -> dict:
    """Each cached result's size as Streamlit keeps it (pickled), at the app's defaults and at the widgets'
    limits, on the embedded pair; the bound is max_entries x the largest."""
    import vitlens as vl
    from PIL import Image

    from vitlens.attribution import METHODS, compare_methods
    from vitlens.reference.shapes import HELD_OUT_SEED, generate, scene_names
    from vitlens.views.filters import max_filter_components

    funcs = cached_functions()
    sizes: dict[str, list[tuple[str, float]]] = {k: [] for k in funcs}
    data = generate(256, seed=HELD_OUT_SEED)  # the "Held-out scenes" slider's largest
    for n in (32, 256):
        sizes["held_out_scenes"].append((f"{n} scenes", pickled_mb(
            ([Image.fromarray(a) for a in data.images[:n]], scene_names(data.labels[:n]), data.masks[:n],
             data.labels[:n]))))
    image = Image.fromarray(data.images[0])
    for name in MODELS:
        m = vl.load_model(name, device="cpu")
        limit = min(64, max_filter_components(m))  # the Filters slider's range
        for k in sorted({min(28, limit), limit}):
            sizes["filters_result"].append((f"{name} k={k}", pickled_mb(vl.embedding_filter_pca(m, n_components=k))))
        for grid in sorted({tuple(m.spec.grid), (64, 64)}):  # the grid boxes go up to 64 x 64
            sizes["position_result"].append((f"{name} grid {grid[0]}x{grid[1]}",
                                             pickled_mb(vl.position_similarity(m, grid=grid))))
        sizes["rollout_result"].append((name, pickled_mb(vl.attention_rollout(m, [image]))))
        sizes["predictions_result"].append((name, pickled_mb(m.top_predictions(m.preprocess([image])))))
        sizes["maps_result"].append((name, pickled_mb(vl.attention_maps(m, image))))
        for method in METHODS:
            sizes["method_table"].append((f"{name} {method}", pickled_mb(compare_methods(
                m, [image], methods=[method], masks=data.masks[:1], target=None,
                method_params={"integrated_gradients": {"n_steps": 64}}.get(method, {})))))
    # per session: remembered() keeps up to MEMO_ENTRIES results of each kind in st.session_state
    memos: dict[str, list[tuple[str, float]]] = {"distance_memo": [], "heads_memo": [], "cka_memo": []}
    images = [Image.fromarray(a) for a in data.images]
    pair = [vl.load_model(name, device="cpu") for name in MODELS]
    for m in pair:
        for n in (32, 256):
            memos["distance_memo"].append((f"{m.spec.name} {n} images", pickled_mb(vl.analyze(
                m, images[:n], batch_size=16, renormalize=True, views=("distance", "prefix")))))
        memos["heads_memo"].append((f"{m.spec.name} 16 images", pickled_mb(vl.head_importance(
            m, images[:16], labels=data.labels[:16], batch_size=64))))
    for n in (8, 32):
        for policy in ("mean", "cls", "patches"):
            memos["cka_memo"].append((f"{policy} {n} images", pickled_mb(vl.cka(
                pair[0], pair[1], images[:n], token_policy=policy, batch_size=min(32, max(4, n // 2))))))
    per_session = {k: {"sizes_mb": {a: round(b, 4) for a, b in v}, "largest_mb": max(b for _, b in v)}
                   for k, v in memos.items()}
    rows = {}
    for f, info in funcs.items():
        if info["kind"] != "cache_data":
            continue
        biggest = max(sizes[f], key=lambda s: s[1]) if sizes[f] else None
        rows[f] = {"max_entries": info["max_entries"], "sizes_mb": {k: round(v, 4) for k, v in sizes[f]},
                   "largest": biggest[0] if biggest else None,
                   "bound_mb": info["max_entries"] * biggest[1] if biggest and info["max_entries"] else None}
    return {"cached_functions": funcs, "results": rows,
            "results_bound_mb": sum(r["bound_mb"] or 0 for r in rows.values()),
            "per_session_memos": per_session, "memo_entries": MEMO_ENTRIES,
            "per_session_bound_mb": MEMO_ENTRIES * sum(v["largest_mb"] for v in per_session.values()),
            "unbounded": [f for f, info in funcs.items() if info["max_entries"] is None]}


def lock_contrast(threads: int = 4, computations: int = 6, hold_s: float = 0.02) -> dict:
    """Threads that each compute several times in a row (as one run of the Attributions view does, one method
    after another), under ``threading.Lock`` (the app's lock before) and under ``FairLock``: per lock, the most
    holds one thread got during one wait of another (``max_bypass``) and the longest wait. ``time.sleep``
    stands in for the computation: it releases the GIL as torch's kernels do."""
    from vitlens_app.fair_lock import FairLock

    out = {}
    for name, make in (("threading.Lock", threading.Lock), ("FairLock", FairLock)):
        lock, records, guard, start = make(), [], threading.Lock(), threading.Barrier(threads)

        def worker(i: int) -> None:
            start.wait()
            for _ in range(computations):
                requested = time.time()
                with lock:
                    granted = time.time()
                    time.sleep(hold_s)
                    released = time.time()
                with guard:
                    records.append({"owner": str(i), "requested": requested, "granted": granted,
                                    "released": released})

        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        fair = lock_fairness(records)
        out[name] = {"max_bypass": max(v["max_bypass"] for v in fair.values()),
                     "max_wait_s": max(v["max_wait_s"] for v in fair.values()),
                     "fifo_bound_s": max(v["wait_bound_s"] for v in fair.values())}
    return {"threads": threads, "computations": computations, "hold_s": hold_s, **out}


def ensure_survey(folder: Path) -> Path:
    """A small finished survey of the embedded pair for the Survey view (made once, then reused)."""
    if folder.exists() and any(folder.iterdir()):
        return folder
    import vitlens as vl
    from vitlens.survey import shapes_source

    vl.survey(MODELS, shapes_source(16), folder, shard_size=8, batch_size=8, progress=False, num_cpus=1)
    return folder


# ---------------------------------------------------------------- main
def table(results: list[dict]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = ["| sessions | switches | p50 s | p95 s | max s | warm p95 s | exceptions | peak RSS MB | model loads "
             "| longest wait s | longest hold s | max bypass | fair | driver failures |", "|" + "---|" * 14]
    for r in results:
        waits = [v["max_wait_s"] for v in r["lock"]["per_session"].values()]
        holds = [v["max_hold_s"] for v in r["lock"]["per_session"].values()]
        lines.append(f"| {r['sessions']} | {r['switches']} | {f(r['view_switch']['p50_s'])} | "
                     f"{f(r['view_switch']['p95_s'])} | {f(r['view_switch']['max_s'])} | "
                     f"{f(r['view_switch_warm']['p95_s'])} | {r['exceptions']} | {r['rss_mb']['peak']:.0f} | "
                     f"{r['model_loads']} | {f(max(waits, default=None))} | {f(max(holds, default=None))} | "
                     f"{r['lock']['max_bypass']} | {r['lock']['fair']} | {len(r['driver_failures'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "app_load" / "app_load.json")
    ap.add_argument("--survey", type=Path, default=ROOT / "runs" / "app_load" / "survey",
                    help="survey folder the Survey view opens (made with vl.survey if missing)")
    ap.add_argument("--bound-only", action="store_true", help="only the caches' bound, no browsers")
    ap.add_argument("--no-bound", action="store_true", help="skip the caches' bound")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.sessions) or args.seconds <= 0:
        ap.error("--sessions takes counts of at least 1 and --seconds a positive duration")
    if not Path(CHROMIUM).exists() and not args.bound_only:
        ap.error(f"needs Chromium at {CHROMIUM} (Debian's chromium package)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"argv": sys.argv[1:], "cpus": os.cpu_count(),
                              "load_average_start": os.getloadavg(), "lock_contrast": lock_contrast()}
    print("lock contrast (4 threads x 6 computations in a row):", json.dumps(
        {k: v for k, v in report["lock_contrast"].items() if k in ("threading.Lock", "FairLock")}))
    if not args.no_bound:
        report["cache_bound"] = cache_bound()
        print(json.dumps({f: {k: r[k] for k in ("max_entries", "largest", "bound_mb")}
                          for f, r in report["cache_bound"]["results"].items()}, indent=1))
        print(f"results caches bound: {report['cache_bound']['results_bound_mb']:.1f} MB (all sessions); "
              f"per-session memos bound: {report['cache_bound']['per_session_bound_mb']:.2f} MB per session")
    if not args.bound_only:
        survey = ensure_survey(args.survey.resolve())
        report["runs"] = []
        for n in args.sessions:
            t = time.time()
            report["runs"].append(measure(n, args.seconds, survey, args.out.parent))
            print(f"{n} session(s): {time.time() - t:.0f} s wall", flush=True)
        report["load_average_end"] = os.getloadavg()
        print(table(report["runs"]))
        for r in report["runs"]:
            for p in r["problems"] + r["stderr_problems"] + [f"driver: {f}" for f in r["driver_failures"]]:
                print(f"  [{r['sessions']} sessions] {p}")
    args.out.write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
