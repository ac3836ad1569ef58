#!/usr/bin/env bash
# Build the documentation site offline: run every tutorial (tutorials/*.py -> docs/tutorials/*.md with
# their figures), then `mkdocs build --strict` (a broken link, a missing page or an API name that no
# longer resolves fails the build). Output: site/ (or the folder given as the first argument).
# Uses .venv (created by scripts/setup.sh), or the Python in $VITLENS_PYTHON (an environment that
# already has requirements.txt and requirements-docs.txt installed). Installs Chromium when kaleido finds no
# browser (scripts/install-chromium.sh, as scripts/test.sh does), or stops in one line saying how to.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${VITLENS_PYTHON:-}" ]; then
    PY=$VITLENS_PYTHON
else
    bash scripts/setup.sh
    PY=.venv/bin/python
fi
SITE=${1:-site}
# no progress bars in the build's output (tqdm's, and Hugging Face's model loading): a page shows stdout only
export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export HF_HUB_OFFLINE=1 NO_MKDOCS_2_WARNING=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the tutorials' figures are PNGs through kaleido, which needs Chrome or Chromium: installed here as the test
# command installs it; where that is impossible (no root, no apt), one line says what is missing and how to get it
FIND_BROWSER="from vitlens.report.export import browser_path; raise SystemExit(browser_path() is None)"
if ! "$PY" -c "$FIND_BROWSER" 2>/dev/null; then
    bash scripts/install-chromium.sh >/dev/null 2>&1 || true
    if ! "$PY" -c "$FIND_BROWSER" 2>/dev/null; then
        echo "docs.sh: the tutorials' figures need Chromium, which is not installed and could not be installed here;" \
             "install it (sudo apt-get install chromium, or sudo bash scripts/install-chromium.sh) and rerun." >&2
        exit 1
    fi
fi
"$PY" scripts/tutorials.py
"$PY" -m mkdocs build --strict --site-dir "$SITE"
