#!/usr/bin/env bash
# Set up the test environment (if needed: serving's, plus the test tools and the browser for
# the /bench page test) and run the whole test suite in two pytest-xdist workers (a test file
# stays on one worker, so its live servers load once; DUET_TEST_WORKERS changes how many). Files
# go out in collection order, which tests/conftest.py makes longest first.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec "${DUET_VENV:-.venv}/bin/python" -m pytest -n "${DUET_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
