"""The documentation site: every public name is on an API page with a docstring in one style, and the
site builds strict with every tutorial executed (what ``bash scripts/docs.sh`` does)."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the packages whose ``__all__`` the API reference documents (plus vitlens.figures' public functions)
PACKAGES = ("vitlens", "vitlens.registry", "vitlens.loading", "vitlens.families", "vitlens.engine", "vitlens.core", "vitlens.attribution",
            "vitlens.compare", "vitlens.report", "vitlens.survey", "vitlens.reference")
#: the modules whose public functions and classes must pass the docstring style check. Every package of
#: PACKAGES is checked; names are listed here only while they still need their docstrings brought to the
#: style (the report of issue 36 lists them).
NOT_YET_STYLED: frozenset[str] = frozenset()
SECTION = re.compile(r"^(\s*)(Args|Arguments|Returns|Yields|Raises|Attributes|Example|Examples|Note|Notes):\s*$", re.M)


def public_names() -> dict[tuple[str, str], object]:
    """(package, name) -> object for every name in the packages' ``__all__`` and vitlens.figures."""
    names = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            names[(package, name)] = getattr(module, name)
    figures = importlib.import_module("vitlens.figures")
    for name, obj in vars(figures).items():
        if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__.startswith("vitlens.figures"):
            names[("vitlens.figures", name)] = obj
    return names


def sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections: name -> its lines (dedented to the section's entries)."""
    found: dict[str, list[str]] = {}
    lines = doc.splitlines()
    current = None
    for line in lines:
        head = SECTION.match(line)
        if head and not head.group(1):
            current = head.group(2)
            found[current] = []
        elif current is not None:
            if line and not line.startswith(" "):
                current = None
            else:
                found[current].append(line)
    return found


def entries(lines: list[str]) -> list[str]:
    """The names of a section's entries: the lines at the section's first indentation, up to their colon."""
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    out = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) == indent:
            out.append(line.strip().split(":", 1)[0].split(" (", 1)[0].strip())
    return out


def style_problems(obj: object) -> list[str]:
    """What keeps ``obj``'s docstring from the style: a docstring; for a function, ``Args:`` with one
    entry per parameter (names that are parameters), ``Returns:``/``Yields:`` when it returns something,
    ``Raises:`` entries as ``ExceptionName: description``."""
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return ["no docstring"]
    if not inspect.isfunction(obj):
        return []
    problems = []
    found = sections(doc)
    signature = inspect.signature(obj)
    params = [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
              for p in signature.parameters.values() if p.name not in ("self", "cls")]
    if params:
        if "Args" not in found:
            problems.append("no Args: section")
        else:
            documented = entries(found["Args"])
            missing = [p for p in params if p not in documented and p.lstrip("*") not in documented]
            extra = [d for d in documented if d not in params and "*" * 0 + d not in [p.lstrip("*") for p in params]]
            if missing:
                problems.append(f"Args: does not name {missing}")
            if extra:
                problems.append(f"Args: names what is not a parameter {extra}")
    annotation = signature.return_annotation
    if annotation not in (inspect.Signature.empty, None, "None") and not ({"Returns", "Yields"} & set(found)):
        problems.append("no Returns: (or Yields:) section")
    for name in entries(found.get("Raises", [])):
        if not re.fullmatch(r"[A-Z]\w*(Error|Exception|Interrupt|Exit)", name):
            problems.append(f"Raises: entry {name!r} is not 'ExceptionName: description'")
    return problems


def resolve(path: str) -> object:
    """The object a ``::: module.name`` line documents."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def shared_scalar(obj: object) -> bool:
    """True for values whose identity says nothing (numbers, strings, paths)."""
    return isinstance(obj, (int, float, str, bytes, Path))


def test_every_public_name_is_on_an_api_page():
    pages = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "api").glob("*.md")))
    documented = set(re.findall(r"^::: ([\w.]+)$", pages, flags=re.M))
    # a function, class or table exported by several packages is documented once, where it is grouped
    # (by identity; not for scalars, which small-int and string interning would make equal by chance)
    same = {id(obj) for obj in map(resolve, documented) if not shared_scalar(obj)}
    missing = [f"{package}.{name}" for (package, name), obj in public_names().items()
               if f"{package}.{name}" not in documented
               and not (not shared_scalar(obj) and id(obj) in same)]
    assert not missing, f"public names on no page of docs/api/: {missing}"


def test_every_public_function_and_class_has_a_docstring_in_the_style():
    problems = {}
    seen = set()
    for (package, name), obj in public_names().items():
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        where = f"{obj.__module__}.{obj.__qualname__}"
        if where in NOT_YET_STYLED:
            continue
        found = style_problems(obj)
        if found:
            problems[where] = found
    assert not problems, "\n".join(f"{k}: {'; '.join(v)}" for k, v in sorted(problems.items()))


def test_the_style_check_finds_what_it_should():
    def good(a: int, *rest: int, b: str = "", **kw: int) -> int:
        """One line.

        Args:
            a: first, [B] ints.
            *rest: more.
            b (str): a name.
            **kw: options.

        Returns:
            The sum.

        Raises:
            ValueError: when ``a`` is negative.
        """
        return a

    def no_args(a: int) -> None:
        """Says nothing of ``a``."""

    def combined(a: int, b: int) -> int:
        """Two at once.

        Args:
            a, b: the numbers.
        """
        return a + b

    def bad_raises() -> None:
        """Raises in a list.

        Raises:
            UnknownModelError, CheckpointError.
        """

    assert style_problems(good) == []
    assert style_problems(no_args) == ["no Args: section"]
    assert style_problems(combined) == ["Args: does not name ['a', 'b']", "Args: names what is not a parameter ['a, b']",
                                        "no Returns: (or Yields:) section"]
    assert style_problems(bad_raises) == ["Raises: entry 'UnknownModelError, CheckpointError.' is not "
                                          "'ExceptionName: description'"]
    assert style_problems(lambda: None) == ["no docstring"]


@pytest.mark.long
def test_the_site_builds_strict_with_every_tutorial(tmp_path):
    """``scripts/docs.sh``: the tutorials run (each cell; a failing one fails the build), their figures
    land on their pages, and ``mkdocs build --strict`` passes (links, pages, API names)."""
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("requirements-docs.txt is not installed (scripts/setup.sh installs it)")
    if shutil.which("chromium") is None and not os.environ.get("CI"):
        pytest.skip("the tutorials' figures are PNGs through kaleido, which needs Chromium")
    env = {**os.environ, "VITLENS_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    site = tmp_path / "site"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "docs.sh"), str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    tutorials = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    assert len(tutorials) >= 6
    for source in tutorials:
        page = (site / "tutorials" / f"{source.stem}.html").read_text()
        images = re.findall(r'<img [^>]*src="([^"]+\.png)"', page)
        assert images, f"{source.stem}: no figure on its page"
        for image in images:
            data = (site / "tutorials" / image).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, image
    for page in ("definitions", "models", "performance", "security", "changelog", "api/loading", "api/views"):
        assert (site / f"{page}.html").is_file(), page
    api = (site / "api" / "views.html").read_text()
    assert 'id="vitlens.analyze"' in api and "Fig. 7" in api


def test_the_docs_build_without_a_browser_stops_in_one_line_naming_the_install(tmp_path):
    """``scripts/docs.sh`` on a machine where kaleido finds no browser and none can be installed (here: a
    BROWSER_PATH that is no file, and an ``apt-get`` that fails): one line naming Chromium and its install
    command, exit 1, before any tutorial runs and never kaleido's own advice."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("apt-get", "sudo"):
        (stubs / name).write_text("#!/bin/sh\necho 'E: no network' >&2\nexit 100\n")
        (stubs / name).chmod(0o755)
    env = {**os.environ, "VITLENS_PYTHON": sys.executable, "BROWSER_PATH": str(tmp_path / "no-chromium"),
           "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "docs.sh"), str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout + proc.stderr
    assert "need Chromium" in lines[0] and "apt-get install chromium" in lines[0]
    assert "kaleido_get_chrome" not in proc.stderr and "tutorial" not in proc.stdout
    assert not (tmp_path / "site").exists()
