"""What the docs build shows (issue 45 item 16): the tutorials' pandas tables styled by the site's CSS, figures drawn at
the text column's width, and a build log without noise (no progress bars, no open_clip warning for a random-init
model built on purpose, no note that signatures need Black or Ruff)."""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tutorials_script():
    spec = importlib.util.spec_from_file_location("vitlens_tutorials_script", ROOT / "scripts" / "tutorials.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_figures_are_drawn_at_the_text_column_width_and_tables_are_styled(tmp_path, monkeypatch):
    """A 1000-px figure shown in the ~690-px column left 7-px legends; tutorial 02's DataFrame (class "dataframe",
    which Material leaves unstyled) ran its headers together."""
    import pandas as pd
    import plotly.graph_objects as go
    import yaml

    from vitlens.report import export

    script = tutorials_script()
    asked = []
    monkeypatch.setattr(export, "figures_png", lambda figs, **kw: asked.append(kw) or [b"png"] * len(figs))
    source = tmp_path / "t.py"
    source.write_text("# %%\nimport plotly.graph_objects as go\ngo.Figure()\n")
    script.run_tutorial(source, tmp_path)
    assert asked == [{"width": script.FIGURE_WIDTH, "scale": 2}] and script.FIGURE_WIDTH <= 720
    assert (tmp_path / "t_fig1.png").read_bytes() == b"png"
    shown = (tmp_path / "t.md").read_text()
    assert f'![figure 1](t_fig1.png){{ width="{script.FIGURE_WIDTH}" }}' in shown
    table = script.display(pd.DataFrame({"method": ["saliency"], "deletion_auc": [0.25]}), "t", {})
    assert 'class="dataframe"' in table
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert "attr_list" in config["markdown_extensions"]  # the figure's { width=... }
    css = "".join((ROOT / "docs" / path).read_text() for path in config["extra_css"])
    for rule in (r"table\.dataframe\s*\{[^}]*border", r"table\.dataframe th,\s*\.md-typeset table\.dataframe td\s*\{"
                 r"[^}]*padding", r"table\.dataframe thead th\s*\{[^}]*font-weight", r"img\s*\{[^}]*max-width: 100%"):
        assert re.search(rule, css), rule


def test_open_clips_random_init_warning_is_dropped_only_where_vitlens_asks_for_random_weights(caplog):
    """``WARNING:root:No pretrained weights loaded for model 'ViT-B-32'`` in the docs build (tutorial 03 builds a
    random-init OpenCLIP model on purpose; its source says "random init")."""
    from vitlens.loading.external import OPEN_CLIP_RANDOM_INIT, _no_random_init_warning

    with caplog.at_level(logging.WARNING):
        with _no_random_init_warning():
            logging.warning(f"{OPEN_CLIP_RANDOM_INIT} 'ViT-B-32'. Model initialized randomly.")
            logging.warning("another warning")
        logging.warning(f"{OPEN_CLIP_RANDOM_INIT} 'ViT-B-32'. Model initialized randomly.")
    assert [r.getMessage()[:30] for r in caplog.records] == ["another warning", OPEN_CLIP_RANDOM_INIT[:30]]


def test_the_docs_build_shows_no_progress_bars_and_can_format_signatures():
    """docs.sh turns tqdm's bars off (vitlens's own, and Hugging Face's through HF_HUB_DISABLE_PROGRESS_BARS), and
    requirements-docs.txt pins a formatter, so mkdocstrings does not say signatures need Black or Ruff."""
    text = (ROOT / "scripts" / "docs.sh").read_text()
    assert re.search(r"export .*TQDM_DISABLE=1", text) and "HF_HUB_DISABLE_PROGRESS_BARS=1" in text
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    code = "from vitlens.progress import Progress\nwith Progress(True, 3, 'bar') as p:\n    p.update(3)\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert re.search(r"^(ruff|black)==", (ROOT / "requirements-docs.txt").read_text(), re.M)
    pytest.importorskip("mkdocstrings_handlers.python")
    from mkdocstrings_handlers.python._internal import rendering

    rendering._get_formatter.cache_clear()
    formatted = rendering._get_formatter()("def f(a: int, b: int) -> int: ...", 20)
    assert formatted != "def f(a: int, b: int) -> int: ..."  # a formatter is installed and wraps the signature
