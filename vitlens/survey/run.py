"""The survey driver: a model zoo x an image set on Ray (a local Ray by default, or a cluster).

Work is (model, image shard). Each model's shards are Ray tasks (``worker.survey_task``), at most
``replicas`` of a model at a time, submitted once its load has answered; the driver writes each result
to the survey folder the moment it arrives and then submits that model's next shard. Ray does the
scheduling and keeps its worker processes for the next task: a process holds the last model it ran
(``SurveyWorker``), so it imports torch once and loads a model once for all the shards it runs of it,
and a process that dies has its task retried in another (which loads the model again). Why tasks on
held models rather than Ray Data: one model per process, a GPU of its own, and a result per shard
written atomically as it lands — which is what resuming needs.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..errors import InvalidParameterError, VitlensError
from ..progress import Progress
from ..words import printable
from ..reference import REFERENCE_NAMES
from .sources import ImageSource, Shard
from .store import (SurveyBusyError, SurveyResult, SurveyStore, checkpoint_of, file_sha256, load_survey, model_key,
                    own_weights, random_init_note, source_count, table_rows, weights_of, write_table)
from ..views.registry import check_views
from .stats import DEFAULT_SURVEY_VIEW_NAMES, survey_views
from .worker import SurveyWorker, survey_task

RAY_INSTALL = {"python": "Install it with: pip install 'vitlens[survey]' (or pip install ray).",
               "cli": "Install it with: pip install 'vitlens[survey]'.",
               "app": "Install it in the app's environment: pip install 'vitlens[survey]'."}


class SurveyError(VitlensError):
    """A survey that cannot start or that stops (e.g. --strict and a model failed)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise SurveyError("Surveys run on Ray, which is not installed.", fixes=RAY_INSTALL) from e
    return ray


#: where a local Ray's servers listen: loopback only (see ``start_ray``)
LOCAL_HOST = "127.0.0.1"
#: what ``start_ray`` changed in os.environ for a local Ray, put back by ``restore_local_env``
_ENV_BEFORE: dict[str, str | None] = {}
#: the private temporary folder a local Ray of ``start_ray`` runs in, removed by ``restore_local_env``
_PRIVATE_TEMP: list[Path] = []


def start_ray(address: str | None, num_cpus: int | None = None) -> tuple[Any, bool, float]:
    """(ray, whether this call started it, seconds it took): a cluster at ``address`` (or
    RAY_ADDRESS), else a local Ray with this machine's cores. A loopback address (``127.0.0.1:PORT``, a local Ray
    that vitlens started) is joined at 127.0.0.1: Ray would otherwise rewrite it to the node IP, where such a Ray does
    not listen, and wait there.

    A local Ray is kept off the network and authenticated (Ray 2.60):

    - every server of it (GCS, raylet and its object manager, the workers' core-worker servers,
      the runtime-env and dashboard agents) listens on 127.0.0.1 only. Ray binds its servers to the
      node IP (ray-project/ray#59852), but ``ray.init(_node_ip_address="127.0.0.1")`` alone turns
      a loopback address back into the routable one (``services.resolve_ip_for_localhost``) unless
      ``ray_constants.ENABLE_RAY_CLUSTER`` is false, as it is on macOS and Windows
      (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, read once at import): it is made false for the call;
    - token authentication is on (RAY_AUTH_MODE=token, whatever it was), with the token file
      (~/.ray/auth_token, or RAY_AUTH_TOKEN_PATH) private to the user, mode 0600: Ray itself
      writes it with the umask's mode, readable by every local user;
    - its session (sockets, logs, spilled objects) lives in a folder inside a private temporary folder of its
      own (``private_ray_temp``: /tmp/vitlens-ray-XXXXXXXX/r, the first mode 0700 for the whole survey, whatever
      Ray does to the second), not the shared /tmp/ray whose session folders any local user may write to; removed
      by ``restore_local_env`` after the Ray shut down. RAY_TMPDIR, when set, is the user's choice and is left to
      Ray.
    """
    ray = _ray()
    t0 = time.perf_counter()
    if ray.is_initialized():
        return ray, False, 0.0
    address = address or os.environ.get("RAY_ADDRESS")
    constants = sys.modules.get("ray._private.ray_constants")
    cluster = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if address:
        loopback = address.rsplit(":", 1)[0] in (LOCAL_HOST, "localhost")
        if loopback and constants is not None and cluster is not None:
            constants.ENABLE_RAY_CLUSTER = False  # a loopback-only Ray is reached at 127.0.0.1, not the node IP
        try:
            ray.init(address=address, log_to_driver=False)
        finally:
            if constants is not None and cluster is not None:
                constants.ENABLE_RAY_CLUSTER = cluster
        return ray, True, time.perf_counter() - t0
    _token_auth_on()
    if constants is not None and cluster is not None:
        constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 as the node IP (see above)
    temp = private_ray_temp()
    try:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                 object_store_memory=200 * 2**20, _node_ip_address=LOCAL_HOST,
                 **({"_temp_dir": str(temp)} if temp is not None else {}))
    except BaseException:
        restore_local_env()
        raise
    finally:
        if constants is not None and cluster is not None:
            constants.ENABLE_RAY_CLUSTER = cluster
    node_ip = getattr(getattr(ray._private.worker, "_global_node", None), "node_ip_address", LOCAL_HOST)
    if node_ip != LOCAL_HOST:  # another Ray version: said in the driver log, and in the manifest
        logging.getLogger("ray").warning("vitlens: the local Ray's node IP is %s, not %s: its servers may listen "
                                         "beyond loopback (token authentication is on).", node_ip, LOCAL_HOST)
    return ray, True, time.perf_counter() - t0


#: the longest unix socket path Linux takes (``sun_path`` is 108 bytes with its NUL)
MAX_SOCKET_PATH = 107
#: what Ray 2.60 adds under its temp folder for its longest socket, ``/session_<date>_<time>_<us>_<pid>/sockets/
#: plasma_store.N`` (about 66 characters with a 7-digit pid), with room to spare
RAY_SOCKET_TAIL = 72
#: the private folder's name under the temporary folder (``mkdtemp`` adds 8 characters), and Ray's folder in it
PRIVATE_PREFIX, RAY_FOLDER = "vitlens-ray-", "r"


def private_ray_temp() -> Path | None:
    """A new folder for a local Ray's session, inside a private folder of the user's (mode 0700) that nothing of
    Ray changes: Ray makes the folder it is given, and its ``sockets/``, ``logs/`` and session folders, mode 0777
    (``try_make_directory_shared``), so the folder it is given is one level below the private one, which keeps
    every other local user out of all of it for the whole survey (issue 62, item 13). Under $TMPDIR when its path
    leaves room for Ray's socket paths (``MAX_SOCKET_PATH``, ``RAY_SOCKET_TAIL``), else /tmp (issue 62, item 12).
    None when RAY_TMPDIR says where Ray's files go (the user's choice)."""
    if os.environ.get("RAY_TMPDIR"):
        return None
    base = tempfile.gettempdir()
    room = MAX_SOCKET_PATH - RAY_SOCKET_TAIL - len(f"/{PRIVATE_PREFIX}XXXXXXXX/{RAY_FOLDER}")
    private = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=base if len(base) <= room else "/tmp"))
    _PRIVATE_TEMP.append(private)
    temp = private / RAY_FOLDER
    temp.mkdir(mode=0o700)
    return temp


def copy_regular_files(source: Path, target: Path) -> int:
    """The regular files under ``source`` copied to ``target`` (folders 0700, files 0600: the copies are the
    user's alone), the number copied. Links are never followed (a link in the folder is skipped, whatever it
    points at), nor are FIFOs, sockets or devices opened: each entry is judged by ``lstat`` first, then opened
    with O_NOFOLLOW | O_NONBLOCK and checked again."""
    copied = 0
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    for entry in os.scandir(source):
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
            copied += copy_regular_files(Path(entry.path), target / entry.name)
        elif stat.S_ISREG(mode):
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as src:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                out = os.open(target / entry.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            copied += 1
    return copied


def token_path() -> Path:
    """The token file a local Ray reads: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def _token_auth_on() -> None:
    """RAY_AUTH_MODE=token for the local Ray about to start, and a private token file (0600):
    created here when there is none (Ray would create it world-readable), tightened when it is
    readable by others. A token given in RAY_AUTH_TOKEN is Ray's to use, as it is."""
    _ENV_BEFORE.setdefault("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE"))
    os.environ["RAY_AUTH_MODE"] = "token"
    if not os.environ.get("RAY_AUTH_TOKEN"):
        path = token_path()
        if not path.is_file():
            from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another process made it meanwhile
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(generate_new_authentication_token())
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
    try:  # Ray caches its config and the token; both are read again now
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # another Ray version: it reads them when it starts
        pass


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM during a survey ends it as Ctrl-C does: finished shards kept, the folder said, exit 130."""
    raise KeyboardInterrupt


def restore_local_env() -> None:
    """Put back what ``start_ray`` changed in os.environ, and remove the private temporary folder it made
    (after the local Ray shut down)."""
    while _PRIVATE_TEMP:
        shutil.rmtree(_PRIVATE_TEMP.pop(), ignore_errors=True)
    for name, value in _ENV_BEFORE.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _ENV_BEFORE.clear()
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception:
        pass


@contextlib.contextmanager
def ray_messages_to(path: Path) -> Iterator[None]:
    """Ray's messages to the driver go to ``path`` instead of the terminal while the block runs:
    its Python logger ("Started a local Ray instance", "Token authentication is enabled ...") and
    the errors the cluster pushes to the driver ("(raylet) Task ... failed. There are 3 retries
    remaining ...", a dead worker's report), which Ray prints to stdout even with
    ``log_to_driver=False``. Ray 2.60 has no setting for the latter: its error listener thread
    calls ``ray._private.worker.print_to_stdstream``, which this replaces for the block (and
    leaves alone where a Ray version lacks it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_logger = logging.getLogger("ray")
    saved_handlers = ray_logger.handlers[:]
    ray_logger.handlers = [handler]
    lock = threading.Lock()

    def to_file(data: dict, ignore_prefix: bool = False) -> None:
        stamp = _dt.datetime.now().isoformat(sep=" ", timespec="milliseconds")
        with lock, path.open("a", encoding="utf-8") as f:
            for line in data.get("lines", []):
                f.write(f"{stamp} ({data.get('pid', 'ray')}) {line}\n")

    worker_module = sys.modules.get("ray._private.worker")
    printer = getattr(worker_module, "print_to_stdstream", None)
    if printer is not None:
        worker_module.print_to_stdstream = to_file  # type: ignore[union-attr]
    try:
        yield
    finally:
        if printer is not None:
            worker_module.print_to_stdstream = printer  # type: ignore[union-attr]
        ray_logger.handlers = saved_handlers
        handler.close()


def _session_logs(ray: Any) -> Path | None:
    """The logs folder of the local Ray session this process started (None where it cannot tell)."""
    try:
        return Path(ray._private.worker._global_node.get_logs_dir_path())
    except Exception:  # another Ray version, or no local node
        return None


#: environment the workers need from the driver (offline mode, caches)
FORWARDED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "TORCH_HOME")


@dataclass
class _Model:
    name: str
    key: str
    pending: list[Shard]  # not yet submitted
    call: Any  # op, keep, *args -> the future of a ``survey_task`` on this model
    futures: dict[Any, Shard]  # submitted, not yet back
    replicas: int = 1  # shards of it computed at once
    load: Any = None
    weights: Any = None
    failed: str = ""
    reused: int = 0  # shards finished by an earlier run
    computed: int = 0  # shards computed by this run, and their images
    images: int = 0


def survey(
    models: Sequence[str],
    images: ImageSource | str,
    out: str | Path,
    address: str | None = None,
    batch_size: int = 32,
    shard_size: int = 256,
    views: Sequence[str] = DEFAULT_SURVEY_VIEW_NAMES,
    num_gpus_per_worker: float = 0.0,
    num_cpus_per_worker: int = 1,
    pretrained: bool = True,
    per_class: bool = False,
    max_images: int | None = None,
    strict: bool = False,
    renormalize: bool = True,
    progress: bool = True,
    num_cpus: int | None = None,
    hash_images: bool = False,
) -> SurveyResult:
    """Survey several models over one image set on Ray; resumable, one tidy table at the end.

    Args:
        models: model names (as ``vl.load_model`` takes them), or local checkpoints with their
            architecture as ``PATH@ARCH`` ("runs/epoch3.safetensors@vit_tiny_patch16_224",
            "ft.pth@ref-vit"; safe-loaded, as ``vl.load_model(PATH, arch=ARCH)``). The sha256 of
            each checkpoint file is recorded; when the file changed since its shards were written,
            they are set aside (kept) and computed again from the new weights, never mixed.
        images: an ``ImageSource`` (``files_source`` / ``shapes_source``; ``clips_source`` for video models: a
            shard is then a set of clips and the survey keeps the ``spacetime`` statistic), or a folder / glob.
        out: the survey folder; a rerun with the same images and settings skips finished shards,
            and new models extend it.
        address: a Ray cluster ("auto", "ray://..."), else RAY_ADDRESS, else a local Ray.
        batch_size: images per forward.
        shard_size: images per task (the unit that is retried and resumed).
        views: any of "distance", "rollout", "predictions", "weights" (the default, ``DEFAULT_SURVEY_VIEW_NAMES``)
            and "components" (``stats.survey_views``: with any view registered with a ``View.survey``).
        num_gpus_per_worker: GPUs each model worker asks Ray for (fractions share a GPU).
        num_cpus_per_worker: CPUs each model worker asks Ray for.
        pretrained: hub weights (False: random init, seeded identically in every worker). The embedded pair and
            ``PATH@ARCH`` checkpoints keep their own weights either way; with False that is said at run time and
            recorded in the manifest (``weights_note``; its ``weights`` says what each model got).
        per_class: with a folder or glob, each file's parent folder is its class.
        max_images: use at most this many images.
        strict: stop at the first model that fails (else record it and finish the others).
        renormalize: attention distance over patch keys renormalised (the default choice).
        progress: one progress bar over all (model, shard) tasks, and on stderr a line per model
            (shards computed this run and reused, or why it failed).
        num_cpus: cores of a local Ray (default: all of this machine's).
        hash_images: record each image file's sha256 besides its size and modification time, so that a file
            replaced with the same size and time is noticed too (a folder keeps the choice it was made with).

    One run writes a folder at a time (a lock on ``out/.lock`` that dies with its process); an image whose
    size, modification time (or hash) changed since its shard was written has that shard set aside and
    computed again, named on stderr.

    Ray's own messages to the driver (start-up, task retries, dead workers) go to
    ``out/logs/ray-driver.log``, not the terminal; a local Ray runs in a private temporary folder
    (``private_ray_temp``), whose session logs are copied to ``out/logs/`` when it shuts down (regular
    files only, links never followed, the copies private: ``copy_regular_files``), then removed.

    Returns:
        A ``SurveyResult`` over the folder: ``table`` (a pandas DataFrame of model, weights, layer, head,
            metric, value, n_images, class), the manifest, and the models that failed with their reasons.

    Raises:
        SurveyError: Ray is missing, or ``strict`` and a model failed.
        SurveyBusyError: another survey is writing to ``out`` now.
    """
    from .sources import files_source

    views = check_views(views, tuple(survey_views()))
    if isinstance(images, ImageSource) and images.kind == "clips":  # clips: their own statistics, whatever views says
        views = (*views, *(k for k, v in survey_views().items() if v.clips and k not in views))
    if not models:
        raise InvalidParameterError("Name at least one model to survey.")
    source = images if isinstance(images, ImageSource) else files_source(images, per_class, max_images, hash_images)
    refuse_out_inside_images(out, source)
    store = SurveyStore(out)
    store.check_out()  # before the lock: a folder that is not a survey's gets no .lock
    with store.lock():
        return _survey_locked(store, models, source, images, address, batch_size, shard_size, views,
                              num_gpus_per_worker, num_cpus_per_worker, pretrained, max_images, strict, renormalize,
                              progress, num_cpus)


def refuse_out_inside_images(out: str | Path, source: ImageSource) -> None:
    """A survey folder inside the folder of its own images is refused before anything is written (a later
    glob would read its files back as images)."""
    if not source.lists_files or not source.files:
        return
    out_path = Path(out).expanduser().resolve()
    root = Path(os.path.commonpath([str(Path(f).parent) for f in source.files]))
    if out_path == root or root in out_path.parents:
        raise InvalidParameterError(f"--out {out} is inside the image folder {root}; put the survey folder "
                                    "somewhere else, so that its files never become images.")


def _survey_locked(store: SurveyStore, models: Sequence[str], source: ImageSource, images: Any,
                   address: str | None, batch_size: int, shard_size: int, views: Sequence[str], num_gpus_per_worker: float,
                   num_cpus_per_worker: int, pretrained: bool, max_images: int | None, strict: bool,
                   renormalize: bool, progress: bool, num_cpus: int | None) -> SurveyResult:
    if isinstance(images, ImageSource) and max_images and len(source) > max_images:
        source = ImageSource.from_dict({**source.to_dict(), "files": source.files[:max_images],
                                        "labels": source.labels[:max_images]} if source.lists_files else
                                       {**source.to_dict(), "n": max_images})
    settings = {"shard_size": shard_size, "batch_size": batch_size, "views": list(views), "renormalize": renormalize}
    manifest = store.open(source, settings)
    recorded = ImageSource.from_dict(manifest["source"])
    if source.stats and recorded.stats and any(h for *_x, h in recorded.stats) != any(h for *_x, h in source.stats):
        from .sources import file_stat  # the folder keeps its own choice of content hashes

        hashed = any(h for *_x, h in recorded.stats)
        source = ImageSource.from_dict({**source.to_dict(),
                                        "stats": [file_stat(f, hashed) for f in source.files]})
    store.bind(manifest, source)
    manifest["source"] = {**manifest["source"], "stats": [list(x) for x in source.stats]}
    shards = source.shards(shard_size)
    names = list(dict.fromkeys(models))
    # the embedded pair and local checkpoints have their own weights
    weights = {name: pretrained or own_weights(name) is not None for name in names}
    repaired = set_aside_damaged(store, manifest, shards, progress)
    for name in names:
        key = model_key(name, weights[name])
        entry = manifest["models"].setdefault(key, {"name": name, "key": key, "pretrained": weights[name],
                                                    "label": name if weights[name] else f"{name} (random init)"})
        if checkpoint_of(name) is not None:
            check_checkpoint(store, entry, name, progress)
        entry.setdefault("weights", weights_of(entry))
        note = None if pretrained else random_init_note(name)
        if note:  # asked for random weights, it keeps its own: said at run time and recorded (issue 45)
            entry["weights_note"] = note
            if progress:
                print(f"{name}: {note}", file=sys.stderr, flush=True)
        entry["status"] = "done" if all(store.done(key, s) for s in shards) and entry.get("spec") else "pending"
        entry.pop("reason", None)
        if entry["status"] == "done" and progress:
            print(printable(f"{entry['label']}: already done ({len(shards)} shard{'s' * (len(shards) != 1)} reused)"),
                  file=sys.stderr, flush=True)
    store.write_manifest(manifest)

    revived = set()
    for key in repaired:  # a finished model of an earlier run, not named now: its damaged shards are recomputed too
        entry = manifest["models"][key]
        if entry.get("status") == "done" and not all(store.done(key, s) for s in shards):
            entry["status"] = "pending"
            revived.add(key)
    todo = {k: e for k, e in manifest["models"].items()
            if (k in revived or (e["name"] in names and e["pretrained"] == weights[e["name"]]))
            and e["status"] != "done"}
    refuse_unknown_names(todo, store, manifest, strict, progress)
    if todo:
        _run(todo, manifest, store, source, shards, settings, address, num_gpus_per_worker, num_cpus_per_worker,
             strict, progress, num_cpus)
    rows = []
    for entry in manifest["models"].values():
        if entry.get("status") == "done":
            states, n, skipped = store.merged(entry["key"], shards)
            entry["n_images"], entry["skipped"] = n, skipped
            if n == 0:  # nothing was read: a failure, said with its reason, never "done (0 images)"
                entry.update(status="failed", reason=no_images_reason(skipped, source_count(manifest["source"])))
                if progress:
                    print(printable(f"{entry.get('label', entry['name'])}: failed: {entry['reason']}"),
                          file=sys.stderr, flush=True)
                if strict:
                    store.write_manifest(manifest)
                    raise SurveyError(f"{entry['name']}: {entry['reason']} (--strict stops at the first failed "
                                      "model).")
                continue
            rows += table_rows(entry["name"], entry["spec"], states, n, list(source.classes),
                               store.read_weights(entry["key"]), renormalize, weights_of(entry))
    write_table(store.out, rows)
    store.write_manifest(manifest)
    return load_survey(store.out)


def refuse_unknown_names(todo: dict[str, dict], store: SurveyStore, manifest: dict, strict: bool,
                         progress: bool) -> None:
    """The models of ``todo`` whose names resolve to nothing (``vitlens.loading.resolve.name_problem``: no weights
    read, no model built) marked failed with the reason a worker would give, and taken out of ``todo`` before Ray
    starts a worker for each (41 bad names cost three minutes of workers)."""
    from ..loading.resolve import name_problem

    for key, entry in list(todo.items()):
        problem = None if entry.get("checkpoint") else name_problem(entry["name"])
        if problem is None:
            continue
        todo.pop(key)
        entry.update(status="failed", reason=problem.message_for("cli"))
        store.write_manifest(manifest)
        if strict:
            raise SurveyError(f"{entry['name']}: {entry['reason']} (--strict stops at the first failed model).")
        if progress:
            print(printable(f"{entry.get('label', entry['name'])}: failed: {entry['reason']}"), file=sys.stderr,
                  flush=True)


def no_images_reason(skipped: list[str], total: int) -> str:
    """Why a model whose shards read no image failed, in words."""
    if not skipped:
        return "no image was read (the image set is empty)"
    shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    return (f"no image could be read: {len(skipped)} of {total} skipped as unreadable ({shown}); check that the "
            "files are images")


def check_checkpoint(store: SurveyStore, entry: dict, name: str, progress: bool) -> None:
    """Record a checkpoint's path, architecture and the sha256 of its file in its manifest entry;
    when the file's weights changed since its shards were written, set those shards aside (kept)
    so that they are computed again from the new weights, and say so in one line."""
    path, arch = checkpoint_of(name)  # type: ignore[misc]
    full = Path(path).expanduser().resolve()
    digest = file_sha256(full) if full.is_file() else None  # a missing file fails when the worker loads it
    old = (entry.get("checkpoint") or {}).get("sha256")
    entry["checkpoint"] = {"path": str(full), "arch": arch, "sha256": digest}
    entry["weights"] = "checkpoint"
    if old is None or digest is None or old == digest:
        return
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    moved = store.set_aside_model(entry["key"], stamp, "weights-changed")
    entry.pop("shards", None)
    entry.pop("spec", None)
    if moved:
        entry.setdefault("set_aside", []).extend(
            {"shard": p.name.split(".")[0], "reason": f"weights changed (sha256 {old[:12]} -> {digest[:12]})",
             "path": str(p.relative_to(store.out)), "time": stamp} for p in moved)
    if progress:
        print(printable(f"{name}: its weights changed since its shards were written (sha256 {old[:12]}... -> "
                        f"{digest[:12]}...): {len(moved)} old shard{'s' * (len(moved) != 1)} set aside "
                        f"(*.weights-changed-{stamp}), not reused; computing them again"), file=sys.stderr, flush=True)


def worker_name(entry: dict) -> str:
    """What a worker loads: the name, or a checkpoint's resolved ``PATH@ARCH``."""
    ckpt = entry.get("checkpoint")
    return f"{ckpt['path']}@{ckpt['arch']}" if ckpt else entry["name"]


def set_aside_damaged(store: SurveyStore, manifest: dict, shards: list[Shard], progress: bool) -> set[str]:
    """Every damaged shard of the folder renamed out of the way (kept, recorded in its model's
    manifest entry under "set_aside", and said on stderr): the keys of the models that had one."""
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    repaired = set()
    for key, entry in manifest["models"].items():
        for shard in shards:
            why, kind = store.problem_kind(key, shard)
            if not why:
                continue
            moved = store.set_aside(key, shard, stamp, kind)
            repaired.add(key)
            where = moved.relative_to(store.out)
            entry.setdefault("set_aside", []).append({"shard": shard.name, "reason": why, "path": str(where),
                                                      "time": stamp})
            (entry.get("shards") or {}).pop(shard.name, None)
            if progress:
                said = f"is damaged ({why})" if kind == "damaged" else why
                print(printable(f"{entry.get('label', entry['name'])}: {shard.name} {said}; set aside as "
                                f"{where}, computing it again"), file=sys.stderr, flush=True)
    return repaired


def _run(todo: dict[str, dict], manifest: dict, store: SurveyStore, source: ImageSource, shards: list[Shard],
         settings: dict, address: str | None, gpus: float, cpus: int, strict: bool, progress: bool,
         num_cpus: int | None) -> None:
    with ray_messages_to(store.out / "logs" / "ray-driver.log"):
        local = not (address or os.environ.get("RAY_ADDRESS"))
        before = signal.getsignal(signal.SIGTERM)
        ray, started, startup = start_ray(address, num_cpus)
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:  # ray.init's own handler exits mid-wait (Ray's C++ stack dump, exit -6): as Ctrl-C instead
            signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        session_logs = _session_logs(ray) if started and local else None  # a cluster keeps its own
        try:
            _submit(ray, todo, manifest, store, source, shards, settings, address, gpus, cpus, strict, progress,
                    startup, session_logs)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
            if started:
                ray.shutdown()
                if session_logs is not None and session_logs.is_dir():  # the local session's own logs, kept
                    try:
                        copy_regular_files(session_logs, store.out / "logs" / f"ray-{session_logs.parent.name}")
                    except OSError:  # a log Ray is still rotating; the survey's results do not depend on it
                        pass
                if local:
                    restore_local_env()


def _submit(ray: Any, todo: dict[str, dict], manifest: dict, store: SurveyStore, source: ImageSource,
            shards: list[Shard], settings: dict, address: str | None, gpus: float, cpus: int, strict: bool,
            progress: bool, startup: float, session_logs: Path | None) -> None:
    total_slots = _slots(ray, gpus, cpus)
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    remote = ray.remote(survey_task).options(num_cpus=cpus, num_gpus=gpus, max_retries=3,
                                             runtime_env={"env_vars": env} if env else None)
    registered = ship_registered_views(ray)
    work: dict[str, _Model] = {}
    for key, entry in todo.items():
        pending = [s for s in shards if not store.done(key, s)]
        replicas = max(1, min(len(pending), total_slots // max(len(todo), 1)))
        model = (worker_name(entry), entry["pretrained"], (entry.get("checkpoint") or {}).get("sha256"))
        w = _Model(entry["label"], key, pending, _caller(remote, SurveyWorker, model, cpus, gpus > 0, registered), {},
                   replicas=replicas, reused=len(shards) - len(pending))
        w.load = w.call("load", bool(pending) or "weights" in settings["views"])
        work[key] = w
        entry["status"] = "running"
        entry["replicas"] = replicas
    manifest["ray"] = {"address": address or os.environ.get("RAY_ADDRESS") or "local", "startup_seconds": startup,
                       "slots": total_slots, "driver_log": "logs/ray-driver.log"}
    if session_logs is not None:  # the local Ray this run started: where it listens, and how clients authenticate
        node = getattr(getattr(ray._private.worker, "_global_node", None), "node_ip_address", None)
        manifest["ray"].update(listen=node, auth=os.environ.get("RAY_AUTH_MODE"))
    if session_logs is not None:
        manifest["ray"]["session_logs"] = f"logs/ray-{session_logs.parent.name}"
    store.write_manifest(manifest)
    _collect(ray, work, manifest, store, source, settings, strict, progress,
             sum(len(w.pending) for w in work.values()))


def _caller(remote: Any, cls: type, model: tuple[str, bool, str | None], cpus: int, use_gpu: bool,
            registered: Any = ()) -> Any:
    """op, keep, *args -> the future of ``survey_task(cls, model, op, ..., keep, *args)`` as a Ray task, with the
    driver's registered views (``registered``, an object ref of them)."""
    return lambda op, keep, *args: remote.remote(cls, model, op, cpus, use_gpu, keep, *args, registered=registered)


def ship_registered_views(ray: Any) -> Any:
    """The views registered in this process (``registry.registered_views``) put in Ray's object store once, for
    every task to register in its worker (issue 62, item 14: a view registered in the driver failed in the workers
    with ``KeyError``); () when there are none.

    Raises:
        SurveyError: a registered view that cannot be sent (its functions cannot be pickled).
    """
    from ..views.registry import registered_views

    views = registered_views()
    if not views:
        return ()
    try:
        return ray.put(views)
    except Exception as e:  # noqa: BLE001 - cloudpickle's errors vary: the view is named, with what failed
        names = ", ".join(v.name for v in views)
        raise SurveyError(f"The views registered here ({names}) cannot be sent to the survey's Ray workers "
                          f"({type(e).__name__}: {e}); define them in a module the workers can import, or survey "
                          "without them.") from e


def _submit_shards(w: _Model, waiting: dict, source: ImageSource, settings: dict) -> None:
    """Submit ``w``'s next shards until ``w.replicas`` of them are out; the last ones tell their process to drop
    the model when done (``worker.survey_task``'s ``keep``)."""
    while w.pending and len(w.futures) < w.replicas:
        shard = w.pending.pop(0)
        fut = w.call("run", bool(w.pending), source.to_dict(), (shard.index, shard.start, shard.stop),
                     tuple(settings["views"]), settings["batch_size"], settings["renormalize"])
        w.futures[fut] = shard
        waiting[fut] = ("shard", w)


def _slots(ray: Any, gpus: float, cpus: int) -> int:
    res = ray.cluster_resources()
    if gpus > 0:
        return max(1, int(res.get("GPU", 0) // gpus))
    return max(1, int(res.get("CPU", 1) // cpus))


def _collect(ray: Any, work: dict[str, _Model], manifest: dict, store: SurveyStore, source: ImageSource,
             settings: dict, strict: bool, progress: bool, total: int) -> None:
    bar = Progress(progress, total, "survey", unit="shard")
    finished = 0
    waiting = {w.load: ("load", w) for w in work.values()}
    interrupted = False
    try:
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1)
            fut = ready[0]
            what, w = waiting.pop(fut)
            entry = manifest["models"][w.key]
            if w.failed:
                continue
            try:
                value = ray.get(fut)
            except Exception as e:  # the model could not load or a shard failed beyond Ray's retries
                _fail(ray, w, entry, _reason(e), waiting, store, manifest, strict, bar)
                continue
            if what == "load":
                if not value["ok"]:
                    _fail(ray, w, entry, value["reason"], waiting, store, manifest, strict, bar)
                    continue
                recorded = (entry.get("checkpoint") or {}).get("sha256")
                if recorded and value.get("checkpoint_sha256") not in (None, recorded):
                    _fail(ray, w, entry, f"its checkpoint file changed while the survey ran (sha256 {recorded[:12]}"
                          f"... when it started, {value['checkpoint_sha256'][:12]}... when loaded); rerun to "
                          "survey the new weights", waiting, store, manifest, strict, bar)
                    continue
                entry.update(spec=value["spec"], source=value["source"], device=value["device"])
                entry["weights"] = value.get("weights") or entry.get("weights")
                if "weights" in settings["views"]:
                    w.weights = w.call("weights", bool(w.pending))
                    waiting[w.weights] = ("weights", w)
                _submit_shards(w, waiting, source, settings)
            elif what == "weights":
                store.write_weights(w.key, value)
            else:
                shard = w.futures.pop(fut)
                store.write_shard(w.key, shard, value)
                w.computed += 1
                w.images += int(value["n_images"])
                entry.setdefault("shards", {})[shard.name] = {
                    "n_images": value["n_images"], "seconds": round(value["seconds"], 3),
                    "skipped": len(value["skipped"]), "pid": value["pid"],
                    "peak_rss_mb": round(value.get("peak_rss_mb", 0.0), 1)}
                finished += 1
                bar.update(finished)
                _submit_shards(w, waiting, source, settings)
            if not w.futures and entry.get("spec") and not any(v[1] is w for v in waiting.values()):
                entry["status"] = "done"
                if w.images or w.reused:  # a model that read no image is said as failed at the end
                    bar.note(done_line(w.name, w.computed, w.images, w.reused))
            store.write_manifest(manifest)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        bar.close()
        # stopped early (--strict): what is still out computes for no one. Not on Ctrl-C or SIGTERM: a ray.cancel that
        # meets a task's reply on its way trips a fatal check in Ray's task manager ("Tried to complete task that was
        # not pending"; the process exited 1 without saying what was kept). Ray's shutdown, or the driver's exit, ends
        # those tasks; in a session that keeps its own Ray, they finish (at most the shards out at that moment).
        if not interrupted:
            _cancel(ray, waiting)


def _cancel(ray: Any, futures: Any) -> None:
    """Cancel Ray tasks still queued or running (a task that has finished or is gone is passed over)."""
    for fut in list(futures):
        with contextlib.suppress(Exception):
            ray.cancel(fut)


def _fail(ray: Any, w: _Model, entry: dict, reason: str, waiting: dict, store: SurveyStore, manifest: dict,
          strict: bool, bar: Progress) -> None:
    w.failed = reason
    entry.update(status="failed", reason=reason)
    bar.drop(len(w.futures) + len(w.pending))  # its shards will not come: the bar's total counts only what will
    mine = [f for f, (_what, owner) in waiting.items() if owner is w]
    for fut in mine:
        waiting.pop(fut)
    _cancel(ray, mine)
    w.pending.clear()
    store.write_manifest(manifest)
    if strict:  # the error says it, once
        raise SurveyError(f"{w.name}: {reason} (--strict stops at the first failed model).")
    bar.note(f"{w.name}: failed: {reason}")


def done_line(name: str, computed: int, images: int, reused: int) -> str:
    """'NAME: done: 1 shard computed this run (64 images), 5 reused'."""
    text = f"{name}: done: {computed} shard{'s' * (computed != 1)} computed this run ({images} images)"
    return text + (f", {reused} reused" if reused else "")


def _reason(e: Exception) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, VitlensError):
        return cause.message_for("cli")
    text = str(e).strip().splitlines()
    return f"{type(cause or e).__name__}: {text[-1] if text else ''}"[:500]
