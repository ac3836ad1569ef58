"""Ray for a survey: a cluster joined as given, or a local Ray kept off the network, authenticated and in a private
folder (``start_ray``), put back as it was after (``restore_local_env``); Ray's messages to the driver sent to the
survey folder's log (``ray_messages_to``) and its session logs copied there (``copy_regular_files``).

docs/security.md, "Surveys on Ray" and "What vitlens keeps on disk, on a shared machine".
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import VitlensError


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
    # Ray's private constants module, read and set by name: the flag is absent from some Ray versions
    constants: Any = sys.modules.get("ray._private.ray_constants")
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
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # compiled, no stub

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # another Ray version: it reads them when it starts
        pass


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
        from ray._raylet import Config  # type: ignore[attr-defined]  # compiled, not in ray's stub

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

    # Ray's private worker module, whose printer is swapped by name (absent from some Ray versions)
    worker_module: Any = sys.modules.get("ray._private.worker")
    printer = getattr(worker_module, "print_to_stdstream", None)
    if printer is not None:
        worker_module.print_to_stdstream = to_file
    try:
        yield
    finally:
        if printer is not None:
            worker_module.print_to_stdstream = printer
        ray_logger.handlers = saved_handlers
        handler.close()


def _session_logs(ray: Any) -> Path | None:
    """The logs folder of the local Ray session this process started (None where it cannot tell)."""
    try:
        return Path(ray._private.worker._global_node.get_logs_dir_path())
    except Exception:  # another Ray version, or no local node
        return None
