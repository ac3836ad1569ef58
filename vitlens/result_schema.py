"""Checking a result file before it becomes a result: every field's type and, where the class's docstring gives
one (``mean_px: [L, H] ...``), its array's number of dimensions (a sequence's length for ``roles: [maps]``), with a
symbol the same size wherever it appears; a dimension may be a symbol (``T'`` too), a number, a symbol plus or minus a
number (``[B, L + 1]``: one more than ``L`` wherever ``L`` appears), a product (``[gh * gw, D]``) or leading ``...``.
One ``ResultFileError`` names the file and the field; nothing raw (``TypeError``, ``JSONDecodeError``, a zip's
``BadZipFile``, ``RecursionError``) escapes ``vl.load_result``.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InvalidParameterError

#: the most bytes the arrays of one ``.npz`` result may inflate to (declared sizes, checked before reading)
MAX_RESULT_BYTES = 256 * 2**20
#: the deepest nesting of lists/objects a ``.json`` result may have
MAX_JSON_DEPTH = 64
_SHAPE_LINE = re.compile(r"^\s+(\w+):\s*\[([A-Za-z0-9_ ,'+*.\-]+)\]", re.M)
#: one dimension: a number, a symbol (primes allowed: ``T'``), a symbol plus or minus a number, or a product
_SYMBOL = r"[A-Za-z_]\w*'*"
_OFFSET = re.compile(rf"^({_SYMBOL})\s*([+-])\s*(\d+)$")
_PRODUCT = re.compile(rf"^{_SYMBOL}(\s*\*\s*{_SYMBOL})+$")


class ResultFileError(InvalidParameterError):
    """A result file that is not what vitlens writes: unreadable, too large, or a field of the wrong type/shape."""


def fail(path: Path, field: str | None, why: str) -> ResultFileError:
    where = f" (field {field!r})" if field else ""
    return ResultFileError(f"{path}{where}: {why}. It is not a result file as vitlens writes it; save the result "
                           "again with result.save(path).")


def json_depth_ok(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests lists/objects at most ``limit`` deep (brackets inside strings ignored)."""
    depth, in_str, escape = 0, False, False
    for ch in text:
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def shapes_of(cls: type) -> dict[str, tuple[str, ...]]:
    """{field: its dimensions' symbols} from the class docstring's ``name: [A, B] ...`` lines."""
    doc = cls.__doc__ or ""
    names = {f.name for f in dataclasses.fields(cls)}
    return {m.group(1): tuple(s.strip() for s in m.group(2).split(",") if s.strip())
            for m in _SHAPE_LINE.finditer(doc) if m.group(1) in names}


def check_fields(path: Path, cls: type, values: dict[str, Any]) -> None:
    """Raise ``ResultFileError`` for a missing field, a field of the wrong type, or an array of the wrong shape."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation this Python cannot resolve: types unchecked
        hints = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise fail(path, f.name, "missing")
            continue
        hint = hints.get(f.name)
        if hint is not None:
            why = _mismatch(values[f.name], hint)
            if why:
                raise fail(path, f.name, why)
    _check_shapes(path, shapes_of(cls), values)


def _check_shapes(path: Path, shapes: dict[str, tuple[str, ...]], values: dict[str, Any]) -> None:
    """Every declared shape against its array (a sequence: its length against a one-symbol shape), each symbol one
    size wherever it appears; offsets (``L + 1``) and products (``gh * gw``) checked once their symbols are known."""
    sizes: dict[str, tuple[int, str]] = {}
    later: list[tuple[str, str, int]] = []  # (field, dimension, size) of offsets and products

    def bind(name: str, symbol: str, size: int) -> None:
        if symbol in sizes and sizes[symbol][0] != size:
            raise fail(path, name, f"{symbol} = {size}, but {sizes[symbol][1]} has {symbol} = {sizes[symbol][0]}")
        sizes.setdefault(symbol, (size, name))

    for name, symbols in shapes.items():
        value = values.get(name)
        if isinstance(value, (tuple, list)) and len(symbols) == 1 and symbols[0] != "...":
            shape: tuple[int, ...] = (len(value),)
        elif isinstance(value, np.ndarray):
            shape = value.shape
        else:
            continue
        dims = list(symbols)
        if dims and dims[0] == "...":  # any leading dimensions: the trailing ones are checked
            dims = dims[1:]
            if len(shape) < len(dims):
                raise fail(path, name, f"an array of {len(shape)} dimensions {list(shape)}, where "
                                       f"[{', '.join(symbols)}] is written")
            shape = shape[len(shape) - len(dims):]
        elif len(shape) != len(dims):
            raise fail(path, name, f"an array of {len(shape)} dimensions {list(shape)}, where "
                                   f"[{', '.join(symbols)}] is written")
        for size, symbol in zip(shape, dims):
            if symbol.isdigit():
                if size != int(symbol):
                    raise fail(path, name, f"size {size} where {symbol} is written")
            elif _OFFSET.match(symbol) or _PRODUCT.match(symbol):
                later.append((name, symbol, int(size)))
            else:
                bind(name, symbol, int(size))
    for name, symbol, size in later:
        offset = _OFFSET.match(symbol)
        if offset:
            base, sign, k = offset.group(1), offset.group(2), int(offset.group(3))
            implied = size - k if sign == "+" else size + k
            if implied < 0:
                raise fail(path, name, f"size {size} where {symbol} is written")
            bind(name, base, implied)
            continue
        factors = [f.strip() for f in symbol.split("*")]
        if all(f in sizes for f in factors):
            want = int(np.prod([sizes[f][0] for f in factors]))
            if size != want:
                raise fail(path, name, f"size {size} where {symbol} = {want} is written")
        else:
            bind(name, symbol, size)  # an unknown product: the same size wherever it is written


def _mismatch(value: Any, hint: Any) -> str:
    """"" when ``value`` fits the annotation ``hint``, else what it is instead (unknown annotations fit)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any or hint is object:
        return ""
    if origin in (typing.Union, types.UnionType):
        whys = [_mismatch(value, a) for a in args]
        return "" if any(not w for w in whys) else whys[0]
    if hint is type(None):
        return "" if value is None else f"{type(value).__name__}, not None"
    if hint is np.ndarray or origin is np.ndarray:
        if not isinstance(value, np.ndarray):
            return f"a {type(value).__name__}, not an array"
        if value.dtype.kind not in "biuf":
            return f"an array of {value.dtype}, not numbers"
        return ""
    if hint is bool:
        return "" if isinstance(value, (bool, np.bool_)) else f"a {type(value).__name__}, not true/false"
    if hint is int:
        return "" if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else \
            f"a {type(value).__name__}, not an integer"
    if hint is float:
        return "" if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) else \
            f"a {type(value).__name__}, not a number"
    if hint is str:
        return "" if isinstance(value, str) else f"a {type(value).__name__}, not text"
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return f"a {type(value).__name__}, not a sequence"
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return f"{len(value)} items, not {len(args)}"
            for v, a in zip(value, args):
                if (why := _mismatch(v, a)):
                    return f"an item is {why}"
        elif args:
            for v in value:
                if (why := _mismatch(v, args[0])):
                    return f"an item is {why}"
        return ""
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return f"a {type(value).__name__}, not a mapping"
        if len(args) == 2:
            for v in value.values():
                if (why := _mismatch(v, args[1])):
                    return f"a value is {why}"
        return ""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "" if isinstance(value, hint) else f"a {type(value).__name__}, not a {hint.__name__}"
    return ""
