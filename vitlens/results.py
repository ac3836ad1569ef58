"""Result objects: small dataclasses of numpy arrays plus metadata, saved to JSON or npz and back.

Compute once, plot from the result (the scikit-learn ``Display`` habit): every view returns
one of these, figure builders take them, reports store them. In a notebook a result prints as
one line, renders as a small HTML table, and becomes a DataFrame (``to_pandas``); ``to_rows``
gives the same tidy rows for CSV.
"""
from __future__ import annotations

import dataclasses
import io
import contextlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from ._lazy import import_everything
from .errors import InvalidParameterError
from .result_schema import MAX_JSON_DEPTH, MAX_RESULT_BYTES, check_fields, fail, json_depth_ok

T = TypeVar("T", bound="Result")
_REGISTRY: dict[str, type["Result"]] = {}


def _load_every_kind() -> None:
    """Load every result kind, so that a file is read in a process that has not computed its kind yet: each kind is
    a class whose module defines it (``Result.__init_subclass__`` registers it), and every result class is one of
    vitlens's public names or names that left its top level for their modules (``vitlens.MOVED``; the report's and
    the comparison's included), so importing the module of each (``vitlens._lazy.import_everything``) imports every
    module that defines a kind (``vitlens.attribution``'s metrics registry imports every metric's module). No module
    is named here."""
    import sys


    import_everything(sys.modules[__name__.rpartition(".")[0]])


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: never a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        # mkstemp creates 0600; give the file the mode a plain open() would (or the old file's)
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_current_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block ends, then raise it: for short writes that must
    finish whole. Without it an interrupt inside ``np.savez`` leaves its zip half-closed, and the
    zip's own clean-up then raises a ValueError in place of the KeyboardInterrupt. Off the main
    thread (where no signal handler can be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])  # the default handler raises KeyboardInterrupt here
        elif caught and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _encode(value: Any) -> Any:
    # import cost: vitlens.core.spec imports torch, which this module does not at import
    from .core.spec import ModelSpec

    if isinstance(value, ModelSpec):
        return {"__spec__": _encode(value.to_dict())}
    if isinstance(value, Result):
        return {"__result__": _encode(value.to_dict())}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


#: the kinds of dtype a saved array may have: booleans, integers, floats (``numpy.dtype.kind``)
ARRAY_KINDS = "biuf"


def _array_fits(items: Any, shape: tuple[int, ...]) -> bool:
    """Whether the nested lists ``items`` are exactly ``shape`` (each level's length, numbers at the bottom),
    judged without building anything."""
    level = [items]
    for n in shape:
        nxt = []
        for v in level:
            if not isinstance(v, list) or len(v) != n:
                return False
            nxt.extend(v)
        level = nxt
    return all(isinstance(v, (int, float, bool)) for v in level)


def _decode_array(value: dict, field: str | None) -> np.ndarray:
    """An encoded array, checked before any memory is taken for it: a plain numeric dtype (``ARRAY_KINDS``: no
    subarray, record or object dtype, whose one item may be megabytes), a shape of non-negative integers within
    the size a result may hold, and exactly that many numbers in the file."""
    path = _CHECKING.path or Path("<result>")
    try:
        dtype = np.dtype(str(value.get("dtype")))
    except TypeError as e:
        raise fail(path, field, f"dtype {str(value.get('dtype'))[:40]!r} is not a numpy dtype") from e
    if dtype.kind not in ARRAY_KINDS or dtype.shape or dtype.fields is not None:
        raise fail(path, field, f"dtype {str(value.get('dtype'))[:40]!r} is not a plain numeric dtype (booleans, "
                                "integers, floats)")
    shape = value.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise fail(path, field, f"shape {str(shape)[:40]} is not a list of non-negative integers")
    count = int(np.prod(shape, dtype=object)) if shape else 1
    if count * dtype.itemsize > MAX_RESULT_BYTES:
        raise fail(path, field, f"shape {shape} of {dtype} would take {count * dtype.itemsize:,} bytes, more than a "
                                f"result may hold ({MAX_RESULT_BYTES:,})")
    items = value["__ndarray__"]
    if not (_array_fits(items, tuple(shape)) if shape else isinstance(items, (int, float, bool))):
        raise fail(path, field, f"its numbers do not fill the declared shape {shape}")
    return np.asarray(items, dtype=dtype).reshape(shape)


def _decode(value: Any, field: str | None = None) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return _decode_array(value, field)
        if "__spec__" in value:
            # import cost: vitlens.core.spec imports torch, which this module does not at import
            from .core.spec import ModelSpec

            return ModelSpec.from_dict(_decode(value["__spec__"]))
        if "__result__" in value:
            return Result.from_dict(_decode(value["__result__"]))
        if "__tuple__" in value:
            return tuple(_decode(v, field) for v in value["__tuple__"])
        return {k: _decode(v, k if field is None else field) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, field) for v in value]
    return value


class Result:
    """Mixin for the dataclass results of the views: save/load, equality of arrays."""

    kind: ClassVar[str] = "result"
    # every subclass is a dataclass: the fields that dataclasses.fields() reads on them (declared, not set, here)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.kind] = cls

    def summary(self) -> str:
        """One line saying what the result holds (used by ``repr``)."""
        return ", ".join(f"{f.name}={_short(getattr(self, f.name))}" for f in dataclasses.fields(self)[:4])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.summary()})"

    def to_rows(self) -> list[dict[str, Any]]:
        """The numbers as tidy rows (one dict per row), for CSV and DataFrames."""
        raise InvalidParameterError(f"{type(self).__name__} has no tabular form.")

    def to_pandas(self) -> Any:
        """``to_rows`` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.to_rows())

    def to_csv(self) -> bytes:
        """``to_rows`` as CSV (UTF-8)."""
        return rows_to_csv(self.to_rows())

    def _repr_html_(self) -> str:
        import html

        try:
            rows = self.to_rows()
        except InvalidParameterError:
            rows = []
        table = ""
        if rows:
            keys = list(rows[0])
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(k)))}</td>" for k in keys) + "</tr>"
                           for r in rows[:10])
            more = f"<p style='color:#666'>... {len(rows) - 10} more rows (to_pandas() for all)</p>" \
                if len(rows) > 10 else ""
            table = f"<table><tr>{head}</tr>{body}</table>{more}"
        return (f"<div><b>{html.escape(type(self).__name__)}</b>: {html.escape(self.summary())}"
                f"{table}</div>")

    @classmethod
    def _from_older(cls, d: dict[str, Any]) -> dict[str, Any]:
        """The fields of a file written by an older vitlens as this version names them (unchanged here)."""
        return d

    def to_dict(self) -> dict[str, Any]:
        """Plain-data dict (arrays stay numpy) of every field, with the result kind."""
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def to_json(self) -> str:
        return json.dumps(_encode(self.to_dict()))

    def save(self, path: str | Path) -> Path:
        """Save to ``.json`` (arrays as nested lists) or ``.npz`` (arrays binary), atomically."""
        path = Path(path)
        if path.suffix == ".json":
            atomic_write_bytes(path, self.to_json().encode())
        elif path.suffix == ".npz":
            d = self.to_dict()
            arrays: dict[str, Any] = {k: v for k, v in d.items() if isinstance(v, np.ndarray)}
            meta = {k: v for k, v in d.items() if not isinstance(v, np.ndarray)}
            buf = io.BytesIO()
            np.savez_compressed(buf, __meta__=np.asarray(json.dumps(_encode(meta))), **arrays)
            atomic_write_bytes(path, buf.getvalue())
        else:
            raise InvalidParameterError(f"Save results as .json or .npz, not {path.suffix or 'no suffix'!r}.")
        return path

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        d = dict(d)
        kind = d.pop("kind", cls.kind)
        if kind not in _REGISTRY:
            _load_every_kind()
        if kind not in _REGISTRY:
            raise InvalidParameterError(f"Unknown result kind {kind!r}: not a file written by vitlens.")
        target = _REGISTRY[kind]
        if cls is not Result and not issubclass(target, cls):
            raise InvalidParameterError(f"This file holds a {kind!r} result, not {cls.kind!r}.")
        d = target._from_older(d)
        names = {f.name for f in dataclasses.fields(target)}
        values = {k: v for k, v in d.items() if k in names}
        if _CHECKING.path is not None:  # loading a file: each field checked, and any failure names it
            check_fields(_CHECKING.path, target, values)
            try:
                # the ignore below: the registry maps the kind to a subclass of cls (checked above)
                return target(**values)  # type: ignore[return-value]
            except InvalidParameterError:
                raise
            except Exception as e:  # a check of the class's own (__post_init__) on values that do not fit
                raise fail(_CHECKING.path, None, f"{type(e).__name__}: {e}") from e
        # the ignore below: the registry maps the kind to a subclass of cls (checked above)
        return target(**values)  # type: ignore[return-value]

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        """Load a result saved by ``save`` (the file says which kind of result it is)."""
        path = Path(path)
        if path.suffix not in (".json", ".npz"):
            raise InvalidParameterError(f"Load results from .json or .npz, not {path.suffix or 'no suffix'!r}.")
        not_a_file = _not_a_file(path)
        if not_a_file:
            raise InvalidParameterError(f"{not_a_file} Check the path.")
        outer = _CHECKING.path
        _CHECKING.path = path
        try:
            d = _read_checked(path)
            if not isinstance(d, dict):
                raise fail(path, None, f"a {type(d).__name__} at the top, not a result object")
            return cls.from_dict(d)
        except InvalidParameterError:
            raise
        except RecursionError as e:
            raise fail(path, None, "nested too deep") from e
        except Exception as e:  # a malformed encoded array, spec or value
            raise fail(path, None, f"{type(e).__name__}: {str(e)[:200]}") from e
        finally:
            _CHECKING.path = outer

    def equals(self, other: object, rtol: float = 0.0, atol: float = 0.0) -> bool:
        """Field-by-field equality; arrays compared with ``np.allclose(rtol, atol)`` (exact by default)."""
        if type(other) is not type(self):
            return False
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                a, b = np.asarray(a), np.asarray(b)
                if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                    return False
            elif isinstance(a, Result):
                if not a.equals(b, rtol=rtol, atol=atol):
                    return False
            elif _encode(a) != _encode(b):
                return False
        return True


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits ('0.00123', '12.3', '1.23e+04'): small scores of
    random-init models stay distinguishable where a fixed 3 decimals would print 0.001 for all."""
    return f"{value:.{digits}g}"


def round_significant(frame: Any, digits: int = 3) -> Any:
    """A DataFrame's float columns rounded to ``digits`` significant digits (numbers stay numbers)."""
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype.kind == "f":
            out[col] = [float(significant(v, digits)) if np.isfinite(v) else v for v in out[col]]
    return out


def _short(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array{list(value.shape)}"
    if isinstance(value, (list, tuple)) and len(value) > 4:
        return f"[{len(value)} items]"
    if isinstance(value, Result):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def rows_to_csv(rows: list[dict[str, Any]]) -> bytes:
    """Rows of dicts as CSV bytes (the columns of the first row)."""
    import csv

    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue().encode()


class _Checking(threading.local):
    path: Path | None = None


#: the file being loaded (``Result.load``), in this thread: ``from_dict`` checks fields against it
_CHECKING = _Checking()


def _not_a_file(path: Path) -> str:
    """'' when ``path`` is a regular file (through any links); else what it is, in words: missing, a folder, a
    FIFO, a device (a link's target named), which is never opened."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"Result file not found: {path}."
    except OSError as e:
        return f"Result file {path} cannot be read ({type(e).__name__}: {e.strerror or e})."
    if stat.S_ISREG(mode):
        return ""
    kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    target = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
    return f"{path}{target} is {kind}, not a result file; not read."


def _read_checked(path: Path) -> Any:
    """The decoded contents of a result file, its size bounded before anything is inflated or parsed deep."""
    import zipfile


    if path.suffix == ".json":
        if path.stat().st_size > MAX_RESULT_BYTES:
            raise fail(path, None, f"{path.stat().st_size:,} bytes, more than a result may hold ({MAX_RESULT_BYTES:,})")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise fail(path, None, f"not readable as UTF-8 text ({type(e).__name__})") from e
        if not json_depth_ok(text):
            raise fail(path, None, f"nested more than {MAX_JSON_DEPTH} deep")
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise fail(path, None, f"not valid JSON ({e})") from e
        return _decode(raw)
    try:
        with zipfile.ZipFile(path) as z:
            inflated = sum(i.file_size for i in z.infolist())
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise fail(path, None, f"not a readable .npz archive ({type(e).__name__}: {e})") from e
    if inflated > MAX_RESULT_BYTES:
        raise fail(path, None, f"its arrays would inflate to {inflated:,} bytes, more than a result may hold "
                               f"({MAX_RESULT_BYTES:,}); not read")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "__meta__" not in data.files:
                raise fail(path, "__meta__", "missing")
            meta_text = str(data["__meta__"])
            if not json_depth_ok(meta_text):
                raise fail(path, "__meta__", f"nested more than {MAX_JSON_DEPTH} deep")
            d = _decode(json.loads(meta_text))
            if not isinstance(d, dict):
                raise fail(path, "__meta__", f"a {type(d).__name__}, not an object")
            for k in data.files:
                if k != "__meta__":
                    try:
                        d[k] = data[k]
                    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                        raise fail(path, k, f"unreadable array ({type(e).__name__}: {e})") from e
    except InvalidParameterError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise fail(path, None, f"not readable ({type(e).__name__}: {e})") from e
    return d


def load_result(path: str | Path) -> Result:
    """Load any saved vitlens result.

    Args:
        path: a ``.json`` or ``.npz`` file written by a result's ``save``.

    Returns:
        The result, as the class that saved it (``AnalysisResult``, ``AttentionDistanceResult``, ...).
    """
    return Result.load(path)
