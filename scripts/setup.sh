#!/usr/bin/env bash
# Create .venv and install vitlens with its pinned requirements (requirements.txt, and the docs site's
# requirements-docs.txt; requirements-nodeps.txt with --no-deps). Idempotent: reinstalls only when
# requirements.txt, requirements-docs.txt, requirements-nodeps.txt or pyproject.toml changed since the last
# successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.vitlens-installed
want=$(cat requirements.txt requirements-docs.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -r requirements.txt -r requirements-docs.txt
    .venv/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
    # setuptools notes every editable install of a flat layout ("Please be careful with folders in your working
    # directory with the same name as your package"): here that folder is the package, so the note is noise
    PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install --quiet --no-deps -e .
    echo "$want" > "$stamp"
fi
