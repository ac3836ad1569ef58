#!/usr/bin/env bash
# Install (if needed) and run the whole test suite offline. Chromium (for the browser tests) is
# installed from Debian's packages when possible; outside CI, tests that need it skip without it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! bash scripts/install-chromium.sh; then
    if [ -n "${CI:-}" ]; then echo "could not install chromium" >&2; exit 1; fi
    echo "warning: chromium could not be installed; browser tests will be skipped" >&2
fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
# the linter and the type checker over the library first (their settings: pyproject.toml's [tool.ruff] and
# [tool.mypy]); mypy's cache (.mypy_cache) also makes tests/test_static_checks.py's run of it quick
.venv/bin/ruff check vitlens
.venv/bin/mypy
# two worker processes (pytest-xdist), each with its share of the cores (tests/conftest.py): the suite's many
# single-threaded stretches (imports, subprocesses, browsers, Ray) overlap. `-n 0` runs it in one process.
# --dist loadgroup: the tests of one shared fixture (one Ray, one app server and browser: conftest's
# SHARED_FIXTURE_GROUPS) run on one worker; with --no-loadscope-reorder the long tests and those groups, which
# conftest puts first, start first, and the short tests even out the end.
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder "$@"
