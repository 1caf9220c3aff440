#!/usr/bin/env bash
# Set up (if needed) and serve the default model on http://127.0.0.1:8000. Extra arguments go to
# `duet serve`, e.g. scripts/serve.sh --engine mlx --port 8080
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/duet serve "$@"
