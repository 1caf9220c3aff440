#!/usr/bin/env bash
# Set up what serving needs (if not done yet) and serve the default model on
# http://127.0.0.1:8000. Extra arguments go to `duet serve`, e.g.
#   scripts/serve.sh --engine mlx --port 8080
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh serve
exec "${DUET_VENV:-.venv}/bin/duet" serve "$@"
