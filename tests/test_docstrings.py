"""Every docstring of vitlens parses into the sections it writes, as the API reference shows them: griffe (the parser
of mkdocstrings, installed with requirements-docs.txt) reads each one in the google style, and no Returns or Yields
section splits into several rows (a wrapped sentence whose continuation line is not indented under its first line
became a second row of the reference's table: 26 of its Returns tables, issue 45), and no Args entry is lost or
misread (griffe's warnings: a line without a ``name: description`` pair, a name not in the signature)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]


def objects(obj: Any) -> Iterator[Any]:
    """Every module, class, function and attribute defined under ``obj`` (aliases are where they are defined)."""
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield member
        if member.is_module or member.is_class:
            yield from objects(member)


def problems(obj: Any) -> list[str]:
    """What the API reference would show wrongly of one object's docstring: a Returns/Yields section of more than one
    item (this project writes one, its wrapped lines indented under the first) and each warning of griffe's parser."""
    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    # griffe's messages go where its logger points: mkdocstrings' handler, once imported in this process (the docs
    # build), patches it to a mkdocs logger (``griffe.patch_loggers``), and a library that configured logging
    # earlier (Ray: dictConfig) disabled existing loggers
    log = getattr(griffe.logger, "_logger", None) or logging.getLogger("griffe")
    while isinstance(log, logging.LoggerAdapter):
        log = log.logger
    handler, level, propagate, disabled = Collect(), log.level, log.propagate, log.disabled
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False
    log.disabled = False
    try:
        sections = griffe.parse_google(obj.docstring)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        log.disabled = disabled
    found = [f"{obj.path}: {message}" for message in said]
    for section in sections:
        if section.kind.value in ("returns", "yields") and len(section.value) > 1:
            second = section.value[1].description.split("\n")[0][:60]
            found.append(f"{obj.path}: {section.kind.value.capitalize()} splits into {len(section.value)} rows (the "
                         f"second starts {second!r}): indent the continuation lines under the first")
    return found


def test_every_docstring_parses_into_the_sections_it_writes():
    package = griffe.load("vitlens", search_paths=[str(ROOT)], resolve_aliases=False)
    documented = [obj for obj in objects(package) if obj.docstring]
    assert len(documented) > 500  # the whole package was read
    found = [line for obj in documented for line in problems(obj)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_split_returns_and_a_misread_args():
    code = '''
def good(a: int) -> int:
    """One.

    Args:
        a: a number,
            wrapped.

    Returns:
        The number, in a sentence that wraps
            onto a second line.
    """


def split(a: int) -> int:
    """Two.

    Returns:
        The number, in a sentence that wraps
        onto a second line.
    """


def misread(a: int, b: int) -> int:
    """Three.

    Args:
        a: the first number, in a sentence that wraps
        onto a second line.
        b, c: two at once.
    """
'''
    module = griffe.visit("example", filepath=Path("example.py"), code=code)
    assert problems(module["good"]) == []
    assert problems(module["split"]) == ["example.split: Returns splits into 2 rows (the second starts 'onto a second "
                                         "line.'): indent the continuation lines under the first"]
    assert len(problems(module["misread"])) >= 2  # the continuation line and the name not in the signature
