"""Shared fixtures. Tests never touch the network: HF_HUB_OFFLINE is set before anything imports
huggingface_hub, and models are random-init timm architectures or the embedded reference pair."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import copy  # noqa: E402
import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The cores shared among the suite's processes: under pytest-xdist (`-n N`) each worker takes its share, so N
# workers never run more threads than the machine has cores (oversubscribed threads are slower than serial work).
# The processes a test starts (the CLI, a tutorial, a survey) inherit the same count through OMP_NUM_THREADS: a
# command's numbers are then those of the same computation in the test's own process (the reductions split alike).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
_THREADS = max(1, min(2, os.cpu_count() or 1) // _WORKERS)
os.environ["OMP_NUM_THREADS"] = str(_THREADS)
torch.set_num_threads(_THREADS)

# A suite started as a background job (`cmd &` in a script, nohup) inherits SIGINT ignored, and so would
# every process it starts: the Ctrl-C tests need Ctrl-C as a terminal delivers it (KeyboardInterrupt here,
# Python's default handler in the `vitlens survey` processes they start).
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The native kernels a test builds go to a private folder of the run's, never the user's ~/.cache/vitlens (a test
# that plants or damages a library there must not reach the real cache); the processes tests start inherit it.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_NATIVE_CACHE = tempfile.mkdtemp(prefix="vitlens-test-native-")
os.environ["VITLENS_CACHE_DIR"] = _NATIVE_CACHE
atexit.register(shutil.rmtree, _NATIVE_CACHE, True)


# ---------------------------------------------------------------- how the suite is spread over processes
#: fixtures that build something costly once and share it (a Ray, a Streamlit server and its browser, a report
#: written by the command line): under pytest-xdist (`--dist loadgroup`, scripts/test.sh) every test that uses
#: one goes to the same worker, so it is built once per suite rather than once per worker. Tests that share a
#: group name share a worker.
SHARED_FIXTURE_GROUPS: dict[str, str] = {
    "local_ray": "ray", "shapes_survey": "ray",
    "app_server": "app-browser", "browser_app": "app-browser", "command_line_pngs": "app-browser",
    "pair_report": "cli-pair-report", "pair_compare": "cli-pair-compare",
}
#: the marker of a test that takes long on its own (the docs build): under xdist such tests, then the groups above,
#: are handed out first, so no worker starts one of them while the other is finishing
LONG = "long"
#: the marker of a test that takes a while on its own but less than a group (a Ray of its own, a browser, a command
#: in a fresh process: ~8 s or more alone): under xdist handed out after the groups and before the short tests, so the
#: short tests even out the end instead of one worker finishing a heavy test while the other idles
HEAVY = "heavy"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{LONG}: a test that runs long on its own; under xdist it starts first")
    config.addinivalue_line("markers", f"{HEAVY}: a test that takes a while alone; under xdist it starts after the "
                            "groups, before the short tests")


def shared_group(item: pytest.Item) -> str | None:
    """The worker group of a test: that of the first shared fixture it uses (``SHARED_FIXTURE_GROUPS``)."""
    for name in getattr(item, "fixturenames", ()):
        if name in SHARED_FIXTURE_GROUPS:
            return SHARED_FIXTURE_GROUPS[name]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist: the tests of a shared fixture marked into one ``xdist_group``; long tests first, then the
    groups (largest first), then the heavy tests, then the rest in their order (a serial run keeps the files' own
    order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    groups: dict[str, int] = {}
    for item in items:
        group = shared_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            groups[group] = groups.get(group, 0) + 1

    def rank(item: pytest.Item) -> tuple[int, int]:
        if item.get_closest_marker(LONG) is not None:
            return (0, 0)
        group = shared_group(item)
        if group is not None:
            return (1, -groups[group])
        return (2, 0) if item.get_closest_marker(HEAVY) is not None else (3, 0)

    items[:] = sorted(items, key=rank)  # stable: the files' order within each rank


@functools.lru_cache(maxsize=16)
def _cached_model(name: str, kwargs_items: tuple) -> object:
    import vitlens as vl

    torch.manual_seed(0)
    return vl.load_model(name, pretrained=False, device="cpu", **dict(kwargs_items))


def get_model(name: str, **kwargs: object):
    """A random-init model, built once per test session (never modify it in a test)."""
    return _cached_model(name, tuple(sorted(kwargs.items())))


@pytest.fixture(scope="session")
def tiny():
    return get_model("vit_tiny_patch16_224")


@pytest.fixture(scope="session")
def ref_vit():
    """The embedded reference ViT, loaded once per session (read-only: a test that changes it copies it first)."""
    import vitlens as vl

    return vl.load_model("ref-vit", device="cpu")


@pytest.fixture()
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for every in-process survey of the session (starting one costs seconds), and for the
    ``vitlens survey --address`` processes of tests/test_survey.py, started as vitlens starts its own
    (``vitlens.survey.run.start_ray``): its servers on 127.0.0.1 only, token authentication on, its session in a
    private folder, so the suite never opens an unauthenticated Ray to the network (``ray.init`` alone listens on every
    interface); the processes tests start inherit RAY_AUTH_MODE.

    One CPU: a survey computes ``CPUs // len(models)`` shards of a model at once, each in a Ray worker process that
    imports torch once (~4 s, ~10 s on a loaded machine) and is reused by the next tasks and surveys of the
    session, while these small surveys compute a shard in milliseconds: with two CPUs a one-model survey would
    start a second process for nothing. Several worker processes per model (shards spread
    over replicas) are exercised by ``test_survey_trust.py::test_a_local_survey_runs_its_ray_in_a_private_folder_and_removes_it``
    (its own local Ray, one CPU per core)."""
    pytest.importorskip("ray")
    from vitlens.survey.run import restore_local_env, start_ray

    ray, _, _ = start_ray(None, num_cpus=1)
    yield ray
    ray.shutdown()
    restore_local_env()


@pytest.fixture(scope="session")
def app_server() -> int:
    """One ``streamlit run serve.py`` for the suite's browser tests, started as a user on a shared machine starts it
    (no --server.address: the repository's .streamlit/config.toml decides; ``VITLENS_APP_TOKEN`` set, so every
    request meets the server's token gate); its port."""
    from test_app import SUITE_TOKEN, served_app

    with served_app(address=None, token=SUITE_TOKEN) as port:
        yield port


@pytest.fixture(scope="module")
def browser_app(app_server):
    """A headless Chromium on the suite's app server for a module's browser tests: (browser, the app's URL with its
    token, which the server trades for its access cookie and takes out of the address); each test opens its own
    context (a new session of the app). Per module, not per suite: Playwright's sync API keeps an
    event loop in this thread while it is open, and another module's own ``sync_playwright()`` (the report and survey
    pages' tests) cannot start beside it."""
    from playwright.sync_api import sync_playwright

    from test_app import CHROMIUM, SUITE_TOKEN

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield browser, f"http://127.0.0.1:{app_server}/?token={SUITE_TOKEN}"
        browser.close()


@pytest.fixture(scope="session")
def shapes_survey(local_ray, tmp_path_factory):
    """A small finished survey folder: ref-vit (done) and an unknown model (failed), 20 scenes in shards of 6."""
    import vitlens as vl
    from vitlens.survey import shapes_source

    out = tmp_path_factory.mktemp("survey") / "zoo"
    result = vl.survey(["ref-vit", "no_such_model_x"], shapes_source(20), out, shard_size=6, batch_size=4,
                       progress=False)
    return out, result


def reference_attention(model: torch.nn.Module, x: torch.Tensor, **forward_kwargs) -> tuple[list, torch.Tensor]:
    """timm's non-fused path on a copy of the model: the input of attn_drop is softmax(q k^T s + mask)."""
    ref = copy.deepcopy(model)
    maps: list[torch.Tensor] = []
    for block in ref.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda _m, inp, _out: maps.append(inp[0].detach().clone()))
    with torch.no_grad():
        out = ref.forward_features(x, **forward_kwargs) if forward_kwargs else ref(x)
    return maps, out
