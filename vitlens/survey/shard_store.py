"""A survey folder: nothing lost, nothing counted twice.

    OUT/manifest.json                  settings, image source, models (spec, status, reason), versions
    OUT/shards/<model>/shard-00003.npz one finished (model, shard): its partial states, written atomically
    OUT/shards/<model>/shard-00003.npz.sha256  its checksum record (sha256 and size of the .npz bytes, and
                                       what the shard is: model key, shard index, image range, the image
                                       set's fingerprint, the settings' digest and its images' sizes and
                                       modification times), written atomically just before the .npz itself
    OUT/.lock                          held (flock) by the one run that writes the folder
    OUT/weights/<model>.json           the weight-only views of a model
    OUT/table.parquet                  the tidy table: model, weights, layer, head, metric, value, n_images, class
    OUT/logs/                          Ray's messages to the driver, and a local Ray's own session logs

The shard files are the record of what is done: a rerun skips every shard whose file exists,
so a driver killed at any moment loses at most the shards in flight, and none is counted twice.
The manifest and the table are rebuilt from them.

A shard is trusted only when its bytes match its checksum record (a folder written before the
records existed: when every array in it reads back). One that is truncated, zeroed, changed or
unreadable is *damaged*: a rerun renames it to ``shard-00003.npz.damaged-<time>`` (kept, and named
in the output and the manifest) and computes it again; ``vl.load_survey`` names it (a warning and
``SurveyResult.damaged``), and reading it raises ``DamagedShardError``, never a zip error.

A shard whose record says it is another shard (another model's, another index or image range, another
image set or settings: a file copied in or over another) is set aside the same way
(``.mismatch-<time>``), and one whose images changed since it was written (size or modification time,
or content with ``hash_images``) as ``.images-changed-<time>``, naming the files; both are computed again.

One run writes a folder at a time: ``SurveyStore.lock`` holds an ``flock`` on ``OUT/.lock`` (the
kernel drops it when the process dies, so a killed run never leaves it stuck), and the manifest is
written by merging with what is on disk, never dropping another run's models.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import os
import io
import json
import stat
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import InvalidParameterError
from ..environment import versions
from ..results import atomic_write_bytes, interrupts_deferred
from . import stats
from .entries import source_count
from .reading import RefusedFile, read_regular
from .sources import ImageSource, Shard

FORMAT = 1
#: settings that must match for a rerun to extend a folder (they change the numbers)
PINNED = ("shard_size", "batch_size", "views", "renormalize")


class DamagedShardError(InvalidParameterError):
    """A shard file of a survey folder that is truncated, zeroed, fails its checksum or cannot be read."""


class DamagedSurveyWarning(UserWarning):
    """A survey folder loaded with damaged shards (``SurveyResult.damaged`` names them)."""


class SurveyBusyError(InvalidParameterError):
    """A survey folder another vitlens survey is writing to now."""


LOCK_NAME = ".lock"
#: the most of a manifest.json that is read (a folder's manifest lists its images: ~150 bytes each)
MAX_MANIFEST_BYTES = 256 * 2**20
#: the most of one shard file that is read (its partial states: kilobytes to a few megabytes for any model)
MAX_SHARD_BYTES = 256 * 2**20
#: the most of a shard's checksum record or a model's weight-views file that is read (a few hundred bytes)
MAX_RECORD_BYTES = 16 * 2**20


def settings_digest(settings: dict[str, Any]) -> str:
    """A short digest of the settings that change a shard's numbers (``PINNED``)."""
    return hashlib.sha256(json.dumps({k: settings.get(k) for k in PINNED}, sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


class SurveyStore:
    """Reads and writes one survey folder."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.manifest_path = self.out / "manifest.json"
        #: what every shard record must say besides its own model and range (set by ``bind``)
        self.fingerprint: str | None = None
        self.settings_digest: str | None = None
        #: the image source now (its files' stats) and the one the folder recorded (to name changed files)
        self.source: ImageSource | None = None
        self.recorded: ImageSource | None = None

    def bind(self, manifest: dict[str, Any], source: ImageSource | None = None) -> None:
        """Check shard records against this manifest's image set and settings (and, with ``source``, against
        the current size/mtime of its images)."""
        self.fingerprint = manifest.get("fingerprint")
        self.settings_digest = settings_digest(manifest.get("settings", {}))
        try:
            self.recorded = ImageSource.from_dict(manifest["source"])
        except (KeyError, TypeError):
            self.recorded = None
        self.source = source

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Own the folder for the block: an exclusive ``flock`` on ``OUT/.lock``, released when the block ends
        or the process dies (never stuck after a kill).

        Raises:
            SurveyBusyError: another process holds it.
        """
        import fcntl

        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = os.pread(fd, 200, 0).decode(errors="replace").strip()
                raise SurveyBusyError(
                    f"{self.out} is being written by another vitlens survey ({held or 'a running process'}); "
                    "wait for it to finish, or use another --out.") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, since {_now()}".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def check_out(self, before_lock: bool = False) -> None:
        """Refuse, before anything is written to it (the lock file included), a folder that is not a survey's: it
        may be missing, empty (or hold only a survey's ``.lock``), or hold a manifest.json; a file is refused too.

        Args:
            before_lock: the check before the lock is taken: a folder whose ``.lock`` a vitlens survey wrote ("pid
                N, since ...") may be another survey's first moments (its manifest being written, none yet), so the
                lock answers for it (busy, or this check again under the lock, ``open``); another tool's ``.lock`` is
                no survey's, and the folder is refused as before.

        Raises:
            InvalidParameterError: ``out`` is a file, or a folder with other things in it and no manifest.
        """
        if self.out.exists() and not self.out.is_dir():
            raise InvalidParameterError(f"{self.out} is a file, not a folder; choose a new --out.")
        if before_lock and self._survey_lock():
            return
        if self.out.is_dir() and not self.manifest_path.is_file() and \
                any(p.name != LOCK_NAME for p in self.out.iterdir()):
            raise InvalidParameterError(f"{self.out} exists and is not a survey folder; choose a new --out.")

    def _survey_lock(self) -> bool:
        """Whether the folder's ``.lock`` is a regular file that a vitlens survey wrote (``lock``: "pid N, ...")."""
        path = self.out / LOCK_NAME
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size > 200:
                return False
            return path.read_bytes()[:4] == b"pid "
        except OSError:
            return False

    def manifest(self) -> dict[str, Any] | None:
        """The folder's manifest (None where there is none), read only when it is a regular file of at most
        ``MAX_MANIFEST_BYTES``."""
        try:
            st = self.manifest_path.stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise InvalidParameterError(f"{self.manifest_path} cannot be read ({e.strerror or type(e).__name__}); "
                                        "use a new --out.") from e
        if not stat.S_ISREG(st.st_mode):
            raise InvalidParameterError(f"{self.manifest_path} is not a regular file, not a survey manifest; use a "
                                        "new --out.")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise InvalidParameterError(f"{self.manifest_path} holds {st.st_size:,} bytes, more than a survey "
                                        f"manifest may ({MAX_MANIFEST_BYTES:,}); not read. Use a new --out.")
        try:
            with open(self.manifest_path, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ValueError(f"more than {MAX_MANIFEST_BYTES:,} bytes")
            data = json.loads(raw)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InvalidParameterError(f"{self.manifest_path} is not a readable survey manifest "
                                        f"({type(e).__name__}: {e}); use a new --out.") from e
        if not isinstance(data, dict) or not isinstance(data.get("models", {}), dict):
            raise InvalidParameterError(f"{self.manifest_path} is not a survey manifest (no models table).")
        return data

    def open(self, source: ImageSource, settings: dict[str, Any]) -> dict[str, Any]:
        """The manifest to continue: a new one, or the folder's own when the images and settings match."""
        old = self.manifest()
        if old is None:
            self.check_out()
            return {"format": FORMAT, "created": _now(), "source": source.to_dict(),
                    "fingerprint": source.fingerprint(), "settings": settings, "models": {}}
        if old.get("fingerprint") != source.fingerprint():
            described = old["source"]["description"]
            raise InvalidParameterError(f"{self.out} holds a survey of other images ({described!r}, "
                                        f"{source_count(old['source'])} images); use a new --out for this image set.")
        before = old["settings"]
        changed = [f"{k}={before.get(k)!r}" for k in PINNED if before.get(k) != settings.get(k)]
        if changed:
            raise InvalidParameterError(f"{self.out} was written with other settings ({', '.join(changed)}); "
                                        "rerun with those, or use a new --out.")
        return old

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Write the manifest, merged with the one on disk: a model another run recorded there and this one does
        not know is kept (added to ``manifest`` too), never dropped."""
        try:
            disk = self.manifest() or {}
        except InvalidParameterError:
            disk = {}
        if disk.get("fingerprint") == manifest.get("fingerprint"):
            for key, entry in (disk.get("models") or {}).items():
                if isinstance(entry, dict) and key not in manifest["models"]:
                    manifest["models"][key] = entry
        manifest = {**manifest, "updated": _now(), "versions": versions()}
        atomic_write_bytes(self.manifest_path, json.dumps(manifest, indent=1, default=_jsonable).encode())

    def shard_path(self, key: str, shard: Shard) -> Path:
        return self.out / "shards" / key / f"{shard.name}.npz"

    def done(self, key: str, shard: Shard) -> bool:
        return self.shard_path(key, shard).is_file()

    def checksum_path(self, key: str, shard: Shard) -> Path:
        return self.out / "shards" / key / f"{shard.name}.npz.sha256"

    def write_shard(self, key: str, shard: Shard, result: dict[str, Any]) -> None:
        """The shard's checksum record, then the shard: each written atomically, in that order, so a
        shard file on disk always has the record of its own bytes (a crash between the two leaves a
        record without its shard, which is not done and is overwritten when it is computed). Ctrl-C
        waits for the shard to be written whole, then stops the survey."""
        with interrupts_deferred():
            self._write_shard(key, shard, result)

    def _write_shard(self, key: str, shard: Shard, result: dict[str, Any]) -> None:
        buf = io.BytesIO()
        meta = {"n_images": result["n_images"], "skipped": result["skipped"], "seconds": result["seconds"],
                "start": shard.start, "stop": shard.stop, "model": key, "shard": shard.index}
        arrays: dict[str, Any] = {"__meta__": np.asarray(json.dumps(meta)), **stats.flatten(result["states"])}
        np.savez_compressed(buf, **arrays)
        data = buf.getvalue()
        record = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), **self._identity(key, shard)}
        self._inside(self.shard_path(key, shard).parent)
        atomic_write_bytes(self.checksum_path(key, shard), json.dumps(record).encode())
        atomic_write_bytes(self.shard_path(key, shard), data)

    def _identity(self, key: str, shard: Shard) -> dict[str, Any]:
        """What a shard's record says it is: model, index, image range, image set, settings, its images' stats."""
        ident: dict[str, Any] = {"model": key, "shard": shard.index, "start": shard.start, "stop": shard.stop,
                                 "fingerprint": self.fingerprint, "settings": self.settings_digest}
        if self.source is not None and self.source.stats:
            ident["images"] = self.source.range_digest(shard.start, shard.stop)
        return ident

    def _mismatch(self, key: str, shard: Shard, record: dict[str, Any]) -> tuple[str, str]:
        """("", "") when the record is this shard's, else (what it says instead, "mismatch" / "images-changed")."""
        if "model" not in record:  # a record written before records said what they are
            return "", ""
        want = self._identity(key, shard)
        for field_ in ("model", "shard", "start", "stop", "fingerprint", "settings"):
            if want[field_] is not None and record.get(field_) != want[field_]:
                return (f"belongs elsewhere: its record says {field_} {record.get(field_)!r}, this is "
                        f"{want[field_]!r} (a file copied in or over another)"), "mismatch"
        if "images" in want and record.get("images") not in (None, want["images"]):
            changed = self.changed_files(shard)
            names = ", ".join(os.path.basename(f) for f in changed[:5]) + (" ..." if len(changed) > 5 else "")
            return f"was computed from images that changed since ({names or 'size or modification time'})", \
                "images-changed"
        return "", ""

    def changed_files(self, shard: Shard) -> list[str]:
        """The files of a shard whose recorded stats differ from their current ones."""
        if self.source is None or self.recorded is None or not self.recorded.stats:
            return []
        return [self.source.files[i] for i in range(shard.start, shard.stop)
                if i < len(self.recorded.stats) and tuple(self.recorded.stats[i]) != tuple(self.source.stats[i])]

    def _verified_bytes(self, key: str, shard: Shard) -> tuple[bytes | None, str]:
        """(the shard's bytes, "") when they can be trusted, else (None, what is wrong, in words)."""
        data, why, _kind = self._checked(key, shard)
        return data, why

    def _checked(self, key: str, shard: Shard) -> tuple[bytes | None, str, str]:
        """(bytes, "", "") for a sound shard, else (None, what is wrong, "damaged" / "mismatch" / "images-changed")."""
        data, why = self._read_verified(key, shard)
        if data is None:
            return None, why, "damaged"
        record, _ = self._record(key, shard)
        why, kind = self._mismatch(key, shard, record or {})
        return (None, why, kind) if why else (data, "", "")

    def _record(self, key: str, shard: Shard) -> tuple[dict[str, Any] | None, str]:
        """(the shard's checksum record, "") or (None, "") where it has none, else (None, what is wrong): read as a
        regular file of at most ``MAX_RECORD_BYTES``."""
        try:
            record = json.loads(read_regular(self.checksum_path(key, shard), MAX_RECORD_BYTES))
        except FileNotFoundError:
            return None, ""
        except RefusedFile as e:
            return None, f"its checksum record {e}"
        except (OSError, ValueError):
            return None, "its checksum record is unreadable"
        return (record, "") if isinstance(record, dict) else (None, "its checksum record is unreadable")

    def _read_verified(self, key: str, shard: Shard) -> tuple[bytes | None, str]:
        """(the bytes, "") when they match their checksum record (or, without one, read back), else (None, why).
        The shard is ``lstat``-ed and its size compared with the record's before any byte is read: a FIFO, a link
        or a device in its place is never opened, a sparse file never read (issue 62, item 10)."""
        path = self.shard_path(key, shard)
        try:
            st = os.lstat(path)
        except OSError as e:
            return None, f"cannot be read ({e.strerror or type(e).__name__})"
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            return None, "empty (0 bytes)"
        record, why = self._record(key, shard)
        if why:
            return None, why
        try:
            want, size = (str(record["sha256"]), int(record["bytes"])) if record is not None else ("", None)
        except (KeyError, TypeError, ValueError):
            return None, "its checksum record is unreadable"
        try:
            data = read_regular(path, MAX_SHARD_BYTES, size)
        except RefusedFile as e:
            return None, str(e)
        except OSError as e:
            return None, f"cannot be read ({e.strerror or type(e).__name__})"
        if not any(data):
            return None, f"zeroed ({len(data)} bytes of zeros)"
        if record is not None:
            if hashlib.sha256(data).hexdigest() != want:
                return None, "fails its checksum (sha256 differs from the one recorded when it was written)"
            return data, ""
        try:  # a folder written before checksum records: trusted only when every array reads back
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                for k in npz.files:
                    npz[k]
                json.loads(str(npz["__meta__"]))
        except Exception as e:  # BadZipFile, a bad CRC, a missing member, ...
            return None, f"cannot be read ({type(e).__name__}: {e})"
        return data, ""

    def problem(self, key: str, shard: Shard) -> str:
        """What is wrong with a shard on disk, in words ("" when it is sound, or not written yet); anything in its
        place that is not a regular file (a FIFO, a link) is named, never opened."""
        if not os.path.lexists(self.shard_path(key, shard)):
            return ""
        return self._verified_bytes(key, shard)[1]

    def problem_kind(self, key: str, shard: Shard) -> tuple[str, str]:
        """(what is wrong, "damaged" / "mismatch" / "images-changed"), or ("", "") for a sound or missing shard."""
        if not os.path.lexists(self.shard_path(key, shard)):
            return "", ""
        _data, why, kind = self._checked(key, shard)
        return why, kind

    def damaged(self, key: str, shards: list[Shard]) -> dict[str, str]:
        """{shard name: what is wrong} for the model's damaged shards."""
        return {s.name: why for s in shards if (why := self.problem(key, s))}

    def set_aside(self, key: str, shard: Shard, stamp: str, why: str = "damaged") -> Path:
        """Rename a shard (and its checksum record) out of the way, kept, as
        ``shard-00003.npz.<why>-<stamp>``: the new path."""
        path = self.shard_path(key, shard)
        moved = path.with_name(f"{path.name}.{why}-{stamp}")
        path.rename(moved)
        record = self.checksum_path(key, shard)
        if record.is_file():
            record.rename(record.with_name(f"{record.name}.{why}-{stamp}"))
        return moved

    def set_aside_model(self, key: str, stamp: str, why: str) -> list[Path]:
        """Every shard of a model (and its weight views) renamed out of the way, kept: the shards' new paths."""
        folder = self.out / "shards" / key
        moved = []
        for path in sorted(folder.glob("*.npz")) if folder.is_dir() else []:
            new = path.with_name(f"{path.name}.{why}-{stamp}")
            path.rename(new)
            moved.append(new)
            record = path.with_name(f"{path.name}.sha256")
            if record.is_file():
                record.rename(record.with_name(f"{record.name}.{why}-{stamp}"))
        views = self.out / "weights" / f"{key}.json"
        if views.is_file():
            views.rename(views.with_name(f"{views.name}.{why}-{stamp}"))
        return moved

    def read_shard(self, key: str, shard: Shard) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        data, why, kind = self._checked(key, shard)
        if data is None:
            raise DamagedShardError(
                f"{self.shard_path(key, shard)} {'is damaged: ' if kind == 'damaged' else ''}{why}. Rerun the same "
                f"vitlens survey command on {self.out}: it sets the damaged shard aside and computes it again.")
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(str(npz["__meta__"]))
            arrays = {k: npz[k] for k in npz.files if k != "__meta__"}
        return stats.unflatten(arrays), meta

    def _inside(self, folder: Path) -> None:
        """Refuse to write through a symlinked folder, or one that resolves outside the survey folder."""
        root = self.out.resolve()
        probe = folder
        while probe != self.out and probe != probe.parent:
            if probe.is_symlink():
                raise InvalidParameterError(f"{probe} is a symbolic link ({os.readlink(probe)}); vitlens writes "
                                            "a survey's files only inside its folder. Remove the link and rerun.")
            probe = probe.parent
        if folder.exists() and root not in folder.resolve().parents and folder.resolve() != root:
            raise InvalidParameterError(f"{folder} resolves outside the survey folder {root}; remove it and rerun.")

    def write_weights(self, key: str, values: dict[str, Any]) -> None:
        self._inside(self.out / "weights")
        atomic_write_bytes(self.out / "weights" / f"{key}.json", json.dumps(values).encode())

    def read_weights(self, key: str) -> dict[str, Any]:
        """A model's weight-only views ({} where there are none), read as a regular file of at most
        ``MAX_RECORD_BYTES``."""
        path = self.out / "weights" / f"{key}.json"
        try:
            return json.loads(read_regular(path, MAX_RECORD_BYTES))
        except FileNotFoundError:
            return {}
        except (RefusedFile, OSError, ValueError) as e:
            raise InvalidParameterError(f"{path} is not a readable weight-views file ({e}); rerun the same vitlens "
                                        "survey command, or remove it and rerun.") from e

    def finished_shards(self) -> int:
        """How many (model, shard) results are on disk."""
        return sum(1 for _ in (self.out / "shards").glob("*/*.npz")) if (self.out / "shards").is_dir() else 0

    def merged(self, key: str, shards: list[Shard]) -> tuple[dict[str, dict[str, Any]], int, list[str]]:
        """The model's states over every shard (in shard order), its image count and skipped files."""
        states: dict[str, dict[str, Any]] = {}
        n, skipped = 0, []
        for shard in shards:
            s, meta = self.read_shard(key, shard)
            try:
                states = stats.merge(states, s) if states else s
            except Exception as e:  # shapes or keys that do not fit the others
                raise DamagedShardError(
                    f"{self.shard_path(key, shard)} does not merge with the model's other shards "
                    f"({type(e).__name__}: {e}). Rerun the same vitlens survey command on {self.out}, or set that "
                    "shard aside by hand (rename it) and rerun.") from e
            n += int(meta["n_images"])
            skipped += meta["skipped"]
        return states, n, skipped


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


