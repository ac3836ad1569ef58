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
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import InvalidParameterError, VitlensError
from ..progress import Progress
from ..words import printable
from .sources import ImageSource, Shard, file_stat, files_source
from .store import (SurveyResult, SurveyStore, checkpoint_of, file_sha256, load_survey, model_key,  # noqa: F401
                    own_weights, random_init_note, source_count, table_rows, weights_of, write_table)
from ..views.registry import check_views, registered_views
from .stats import DEFAULT_SURVEY_VIEW_NAMES, survey_views
# the Ray set-up and the folder's checks before Ray: their own modules, importable from here as before
from .ray_setup import (LOCAL_HOST, MAX_SOCKET_PATH, PRIVATE_PREFIX, RAY_FOLDER, RAY_INSTALL,  # noqa: F401
                        RAY_SOCKET_TAIL, SurveyError, _ENV_BEFORE, _PRIVATE_TEMP, _ray, _session_logs,
                        _token_auth_on, copy_regular_files, private_ray_temp, ray_messages_to, restore_local_env,
                        start_ray, token_path)
from .checks import (check_checkpoint, no_images_reason, refuse_out_inside_images, refuse_unknown_names,  # noqa: F401
                     set_aside_damaged, worker_name)
from .worker import SurveyWorker, survey_task


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM during a survey ends it as Ctrl-C does: finished shards kept, the folder said, exit 130."""
    raise KeyboardInterrupt


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
    views = check_views(views, tuple(survey_views()))
    if isinstance(images, ImageSource) and images.kind == "clips":  # clips: their own statistics, whatever views says
        views = (*views, *(k for k, v in survey_views().items() if v.clips and k not in views))
    if not models:
        raise InvalidParameterError("Name at least one model to survey.")
    source = images if isinstance(images, ImageSource) else files_source(images, per_class, max_images, hash_images)
    refuse_out_inside_images(out, source)
    store = SurveyStore(out)
    store.check_out(before_lock=True)  # before the lock: a folder that is not a survey's gets no .lock
    with store.lock():
        return _survey_locked(store, models, source, images, address, batch_size, shard_size, views,
                              num_gpus_per_worker, num_cpus_per_worker, pretrained, max_images, strict, renormalize,
                              progress, num_cpus)


def _survey_locked(store: SurveyStore, models: Sequence[str], source: ImageSource, images: Any,
                   address: str | None, batch_size: int, shard_size: int, views: Sequence[str],
                   num_gpus_per_worker: float, num_cpus_per_worker: int, pretrained: bool, max_images: int | None,
                   strict: bool, renormalize: bool, progress: bool, num_cpus: int | None) -> SurveyResult:
    if isinstance(images, ImageSource) and max_images and len(source) > max_images:
        source = ImageSource.from_dict({**source.to_dict(), "files": source.files[:max_images],
                                        "labels": source.labels[:max_images]} if source.lists_files else
                                       {**source.to_dict(), "n": max_images})
    settings = {"shard_size": shard_size, "batch_size": batch_size, "views": list(views), "renormalize": renormalize}
    manifest = store.open(source, settings)
    recorded = ImageSource.from_dict(manifest["source"])
    if source.stats and recorded.stats and any(h for *_x, h in recorded.stats) != any(h for *_x, h in source.stats):
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
