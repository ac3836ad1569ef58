"""The linter and the type checker that scripts/test.sh runs before the suite, run again here, so that a regression
fails the suite however it is started (plain pytest too): ruff and mypy pass on vitlens/ with the settings of
pyproject.toml, and every `# type: ignore` left in the checked modules names its error code and says why."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a cold mypy cache checks torch's stubs too (about two minutes of one core); scripts/test.sh warms it first
MYPY_TIMEOUT_S = 600
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _unchecked_modules() -> list[str]:
    """The module patterns of pyproject.toml's overrides with ignore_errors (the TEMPORARY block while other branches
    rewrite them): their comments are not the checked code's."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [m for o in config["tool"]["mypy"].get("overrides", []) if o.get("ignore_errors")
            for m in ([o["module"]] if isinstance(o["module"], str) else o["module"])]


def _is_unchecked(path: Path, patterns: list[str]) -> bool:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return any(module == p or (p.endswith(".*") and module.startswith(p[:-1])) for p in patterns)


def test_ruff_passes_on_the_library():
    pytest.importorskip("ruff", reason="ruff is installed by scripts/setup.sh (requirements-docs.txt)")
    done = _run("ruff", "check", "vitlens", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_passes_on_the_library():
    pytest.importorskip("mypy", reason="mypy is installed by scripts/setup.sh (requirements-docs.txt)")
    done = _run("mypy", timeout=MYPY_TIMEOUT_S)  # files, plugin and overrides: pyproject.toml's [tool.mypy]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout


def _unexplained(lines: list[str]) -> tuple[int, list[int]]:
    """(the ignores seen, the indices of those without an error code or a reason: a comment after the ignore, or
    the comment line just above it)."""
    seen, wrong = 0, []
    for i, line in enumerate(lines):
        found = IGNORE.search(line)
        if found is None:
            continue
        seen += 1
        above = lines[i - 1].strip() if i else ""
        said = found["rest"].strip().startswith("#") or (above.startswith("#") and "type: ignore" not in above)
        if not found["codes"] or not said:
            wrong.append(i)
    return seen, wrong


def test_every_type_ignore_names_its_code_and_says_why():
    patterns = _unchecked_modules()
    total, wrong = 0, []
    for path in sorted((ROOT / "vitlens").rglob("*.py")):
        if _is_unchecked(path, patterns):
            continue
        lines = path.read_text().splitlines()
        seen, bad = _unexplained(lines)
        total += seen
        wrong += [f"{path.relative_to(ROOT)}:{i + 1}: {lines[i].strip()}" for i in bad]
    assert total > 0  # the scan reads the library's comments (it found the ones that remain)
    assert not wrong, "a type: ignore without its code or its reason:\n" + "\n".join(wrong)


def test_the_reason_check_refuses_an_ignore_without_code_or_reason():
    bare = ["x = f()  # type: ignore  # f's stub is wrong"]
    coded = ["x = f()  # type: ignore[arg-type]"]
    beside = ["x = f()  # type: ignore[arg-type]  # f's stub is wrong"]
    above = ["# the ignore below: f's stub is wrong", "x = f()  # type: ignore[arg-type]"]
    above_is_an_ignore = ["y = g()  # type: ignore[misc]", "x = f()  # type: ignore[arg-type]"]
    assert _unexplained(bare) == (1, [0])
    assert _unexplained(coded) == (1, [0])
    assert _unexplained(beside) == (1, [])
    assert _unexplained(above) == (1, [])
    assert _unexplained(above_is_an_ignore) == (2, [0, 1])
