"""The README tells the truth: its API tour runs as written, top to bottom, offline; the files and
commands it names exist."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start: end if end > 0 else None]


@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_the_api_tour_runs_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", section("API tour"), flags=re.S)
    assert len(blocks) >= 2
    script = tmp_path / "tour.py"
    script.write_text("\n".join(blocks))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # OMP_NUM_THREADS: tests/conftest.py
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "analysis.json").is_file() and (tmp_path / "distance.html").is_file()
    assert "AttentionDistanceResult(ref-vit" in proc.stdout and "deletion_auc" in proc.stdout


def test_files_the_readme_names_exist():
    for name in re.findall(r"\]\(([^)#]+)\)", README):
        if not name.startswith("http"):
            assert (ROOT / name).exists(), name
    for name in re.findall(r"`((?:analyses|scripts|docs|tests|vitlens)/[\w./-]+)`", README):
        assert (ROOT / name).exists(), name
    assert "paper-notes.md" not in README


# --- the set-up scripts the README names

def test_setup_sh_silences_only_setuptools_editable_note():
    """scripts/app.sh runs setup.sh, whose ``pip install -e .`` made setuptools print "Please be careful with
    folders in your working directory with the same name as your package" (the flat layout's note: here that
    folder is the package). The install runs under a PYTHONWARNINGS filter for that one warning."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    line = next(ln for ln in text.splitlines() if "pip install" in ln and " -e ." in ln)
    value = re.search(r'PYTHONWARNINGS="([^"]+)"', line).group(1)
    action, message = value.split(":")[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings(action, message=re.escape(message))
        warnings.warn("Editable installation.\n!!\n\nPlease be careful with folders in your working directory")
        warnings.warn("Some other setuptools warning")
    assert [str(w.message) for w in caught] == ["Some other setuptools warning"]
