"""Run the tutorials (jupytext percent-format scripts under ``tutorials/``) and write each as a page.

Each ``tutorials/NN_name.py`` is split at its ``# %%`` lines. A ``# %% [markdown]`` cell becomes prose
(its ``# `` prefixes dropped); a code cell is executed, in order, in one namespace per tutorial, and the
page shows its code, what it printed, and its last expression the way a notebook would: a plotly figure
as a PNG (through kaleido, the same export as ``vitlens report --png``; a tutorial's figures are rendered
together when it ends, one browser for them all), a pandas DataFrame as a table,
anything else as its repr. Pages go to ``docs/tutorials/NN_name.md``, figures beside them; a cell that
raises stops the run with its traceback and a non-zero exit, so a tutorial that no longer runs fails
the docs build (and so CI). Each tutorial runs in its own Python process (what one registers, another
never sees) and in a fresh temporary working directory. Where the platform forks (Linux, macOS), that process is a
fork of the runner after it has imported the libraries every tutorial imports (torch, timm, transformers, plotly,
vitlens' modules): the imports, most of a small tutorial's time, are paid once instead of once per tutorial; the
runner itself runs no tutorial code, so each child starts from the same clean state a fresh interpreter would
reach by importing them (``VITLENS_TUTORIAL_FORK=0``: a fresh interpreter per tutorial, as on Windows).

    python scripts/tutorials.py                 # every tutorial
    python scripts/tutorials.py 01_four_views   # some, by name
"""
from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "tutorials"
PAGES = ROOT / "docs" / "tutorials"
CELL = re.compile(r"^# %%(.*)$", re.M)
#: a figure's width in CSS pixels on a page: the docs theme's text column (Material's, ~690 px on a wide screen), so
#: its fonts and legends show at their size instead of a 1000-px figure shrunk to 69% (7-px legends); drawn at
#: twice the pixels (``FIGURE_SCALE``) so it stays sharp on a high-density screen, and scaled down with the column
#: on a narrow one (docs/stylesheets/extra.css)
FIGURE_WIDTH = 690
FIGURE_SCALE = 2
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def split_cells(text: str) -> list[tuple[str, str]]:
    """The ``(kind, body)`` cells of a percent-format script, kind ``"markdown"`` or ``"code"``."""
    marks = list(CELL.finditer(text))
    cells = []
    for i, mark in enumerate(marks):
        body = text[mark.end(): marks[i + 1].start() if i + 1 < len(marks) else len(text)].strip("\n")
        kind = "markdown" if "[markdown]" in mark.group(1) else "code"
        if kind == "markdown":
            body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
        if body.strip():
            cells.append((kind, body))
    return cells


def display(value: Any, stem: str, figures: dict[str, Any]) -> str:
    """Markdown for a cell's last value: a figure as a PNG file (kept in ``figures`` under its file name, to be
    rendered with the tutorial's others: one browser for them all), a DataFrame as a table, else its repr."""
    if value is None:
        return ""
    if type(value).__module__.startswith("plotly") and hasattr(value, "to_image"):
        number = len(figures) + 1
        name = f"{stem}_fig{number}.png"
        figures[name] = value.to_dict()  # as it is now: a later cell that changes the figure changes no page
        return f"![figure {number}]({name}){{ width=\"{FIGURE_WIDTH}\" }}\n"
    if type(value).__name__ == "DataFrame" and hasattr(value, "to_html"):
        return value.to_html(max_rows=40, float_format=lambda v: f"{v:.4g}", border=0) + "\n"
    return "```text\n" + repr(value) + "\n```\n"


def run_tutorial(source: Path, out_dir: Path = PAGES) -> float:
    """Execute one tutorial and write its page; returns the seconds it took. Raises on a failing cell."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = source.stem
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(source)}
    parts: list[str] = []
    figures: dict[str, Any] = {}
    start = time.perf_counter()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix=f"vitlens-{stem}-") as work:
        os.chdir(work)
        try:
            for number, (kind, body) in enumerate(split_cells(source.read_text()), 1):
                if kind == "markdown":
                    parts.append(body + "\n")
                    continue
                parts.append("```python\n" + body + "\n```\n")
                tree = ast.parse(body)
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                buffer = io.StringIO()
                value = None
                try:
                    with contextlib.redirect_stdout(buffer):
                        exec(compile(tree, f"{source.name} cell {number}", "exec"), namespace)
                        if last is not None:
                            value = eval(compile(ast.Expression(last.value), f"{source.name} cell {number}", "eval"),
                                         namespace)
                except Exception:
                    sys.stderr.write(buffer.getvalue())
                    raise RuntimeError(f"{source.name}: cell {number} failed:\n{traceback.format_exc()}") from None
                printed = ANSI.sub("", buffer.getvalue())
                if printed.strip():
                    parts.append("```text\n" + printed.rstrip() + "\n```\n")
                shown = display(value, stem, figures)
                if shown:
                    parts.append(shown)
        finally:
            os.chdir(cwd)
    if figures:  # each as it was when its cell ended
        from vitlens.report.export import figures_png
        for name, png in zip(figures, figures_png(list(figures.values()), width=FIGURE_WIDTH, scale=FIGURE_SCALE)):
            (out_dir / name).write_bytes(png)
    seconds = time.perf_counter() - start
    note = (f"\n---\n*This page is the output of `tutorials/{source.name}`, executed by `scripts/docs.sh` "
            "at every build of the site. Run it yourself with `python tutorials/" + source.name + "`.*\n")
    (out_dir / f"{stem}.md").write_text("\n".join(parts) + note)
    return seconds


def jobs_here() -> int:
    """How many tutorials run at once: ``VITLENS_TUTORIAL_JOBS``, else one per core.

    Each tutorial's process gets an equal share of the cores as its thread count (``OMP_NUM_THREADS``), so
    two tutorials on two cores run one thread each rather than oversubscribing; a tutorial spends much of its
    time importing and exporting figures through kaleido, which the other one's computing overlaps.
    """
    value = os.environ.get("VITLENS_TUTORIAL_JOBS")
    return max(1, int(value)) if value else max(1, os.cpu_count() or 1)


#: what every tutorial imports, imported once by the runner before it forks a process per tutorial (imports only:
#: no module here starts a thread, a Ray or a browser when imported, so a fork of the runner is as clean as a fresh
#: interpreter that imported them)
PRELOAD = ("numpy", "torch", "timm", "transformers", "safetensors.torch", "pandas", "duckdb", "plotly.graph_objects",
           "plotly.io", "vitlens", "vitlens.loading", "vitlens.engine", "vitlens.figures", "vitlens.attribution",
           "vitlens.families", "vitlens.reference.shapes", "vitlens.report.export", "vitlens.survey")


def forks() -> bool:
    """Whether each tutorial's process is a fork of this runner (after ``PRELOAD``): where ``os.fork`` exists and
    ``VITLENS_TUTORIAL_FORK`` is not ``0``."""
    return hasattr(os, "fork") and os.environ.get("VITLENS_TUTORIAL_FORK", "1") != "0"


def preload() -> None:
    """Import ``PRELOAD`` (a module that is not installed is left to the tutorial that needs it to report)."""
    import importlib

    sys.path.insert(0, str(ROOT))
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def run_one(source: Path) -> int:
    """One tutorial in this process: its page written, exit status 0; 1 with the failing cell's traceback."""
    try:
        run_tutorial(source)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


_STARTED: list[subprocess.Popen] = []


def start(source: Path) -> int:
    """The process id of a child that runs ``source``: a fork of this runner (``forks()``), else a fresh
    interpreter running this script with ``--one``."""
    if not forks():
        proc = subprocess.Popen([sys.executable, __file__, "--one", str(source)])
        _STARTED.append(proc)  # kept, so that no Popen reaps it (``main`` waits for it by its id)
        return proc.pid
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run the tutorial, leave without running the runner's exit handlers
        code = 1
        try:
            code = run_one(source)
        except BaseException:  # noqa: BLE001 - a crash outside a cell still fails the tutorial, with its traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def main(argv: list[str]) -> int:
    """Run the tutorials named in ``argv`` (all when empty), ``jobs_here()`` at a time, each in its own process;
    exit status 1 when one fails (the others still finish; the failing one's traceback is printed)."""
    sources = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if argv:
        sources = [s for s in sources if s.stem in argv]
        missing = set(argv) - {s.stem for s in sources}
        if missing:
            print(f"no tutorial named {', '.join(sorted(missing))} under {SOURCES}", file=sys.stderr)
            return 2
    jobs = min(jobs_here(), len(sources)) or 1
    if jobs > 1:  # before torch is imported (here or in a fresh interpreter): its thread count is read once
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    if forks():
        preload()
    pending, running, failed = list(sources), {}, []
    while pending or running:
        while pending and len(running) < jobs:
            source = pending.pop(0)
            running[start(source)] = (source, time.perf_counter())
        pid, status = os.waitpid(-1, 0)  # the next child to end (the runner starts no other)
        if pid not in running:
            continue
        source, began = running.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"tutorial {source.stem} failed", file=sys.stderr)
            failed.append(source.stem)
        else:
            print(f"tutorial {source.stem}: {time.perf_counter() - began:.1f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:2] == ["--one"]:
        raise SystemExit(run_one(Path(sys.argv[2])))
    raise SystemExit(main(sys.argv[1:]))
