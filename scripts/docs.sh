#!/usr/bin/env bash
# Build the documentation site offline: run every tutorial (tutorials/*.py -> docs/tutorials/*.md with
# their figures), then `mkdocs build --strict` (a broken link, a missing page or an API name that no
# longer resolves fails the build). Output: site/ (or the folder given as the first argument).
# Uses .venv (created by scripts/setup.sh), or the Python in $VITLENS_PYTHON (an environment that
# already has requirements.txt and requirements-docs.txt installed).
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
"$PY" scripts/tutorials.py
"$PY" -m mkdocs build --strict --site-dir "$SITE"
