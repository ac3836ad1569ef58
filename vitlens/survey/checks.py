"""What a survey's driver settles in the folder before Ray: an ``--out`` inside its own images refused, names that
resolve to nothing failed without a worker, a checkpoint's file recorded (its shards set aside when its weights
changed), every damaged or misplaced shard set aside to be computed again."""
from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path

from ..errors import InvalidParameterError
from ..words import printable
from .ray_setup import SurveyError
from .sources import ImageSource, Shard
from .store import SurveyStore, checkpoint_of, file_sha256
from ..loading.resolve import name_problem


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


def refuse_unknown_names(todo: dict[str, dict], store: SurveyStore, manifest: dict, strict: bool,
                         progress: bool) -> None:
    """The models of ``todo`` whose names resolve to nothing (``vitlens.loading.resolve.name_problem``: no weights
    read, no model built) marked failed with the reason a worker would give, and taken out of ``todo`` before Ray
    starts a worker for each (41 bad names cost three minutes of workers)."""
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
    found = checkpoint_of(name)
    if found is None:  # the caller checks first: only a checkpoint has a file to hash
        raise InvalidParameterError(f"{name!r} is not a local checkpoint named PATH@ARCH.")
    path, arch = found
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
