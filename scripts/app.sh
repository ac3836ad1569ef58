#!/usr/bin/env bash
# Install (if needed) and start the app on http://127.0.0.1:8501 (offline: embedded models by default).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# serve.py: app.py behind the server-side check of VITLENS_APP_TOKEN (docs/security.md)
exec .venv/bin/python -m streamlit run serve.py "$@"
