#!/usr/bin/env bash
# Creates .venv in the repository root and installs the project into it (idempotent).
# torch is pinned first to the CPU test build (2.13.0); on a GPU machine install a CUDA build
# by hand instead (README.md, "Running on a GPU").
# Prints a line per step; pip's noise (location warnings from index settings, the
# editable-install banner, script-location hints) is filtered out, its errors are not.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf 'setup: %s\n' "$*"; }

# pip's lines that say nothing about this install: the location warnings of index
# settings that name absent directories, and setuptools' editable-install banner (a
# BuildBackendWarning framed by two "!!" lines, then the source line it points at).
# Everything else, errors included, is passed through.
filter_pip() {
  awk '
    /WARNING: Location .* is ignored: it is neither a file nor a directory/ { next }
    /BuildBackendWarning: Editable installation/ { skip = 1; bangs = 0; n = 0; next }
    skip == 1 { if ($0 ~ /^ *!!$/ && ++bangs == 2) skip = 2; else if (++n > 40) skip = 0; next }
    skip == 2 { skip = 0; if ($0 ~ /with strategy, WheelFile/) next }
    { print }
  '
}

# pip install, quiet and filtered; a failing pip still fails the script (pipefail).
pip_install() {
  python -m pip install -q --disable-pip-version-check --no-warn-script-location "$@" 2>&1 | filter_pip
}

if [ ! -x .venv/bin/python ]; then
  step "creating .venv ($(python3 --version 2>&1))"
  python3 -m venv .venv
else
  step "using the existing .venv"
fi
. .venv/bin/activate
step "pip (upgrade)"
pip_install --upgrade pip
step "torch 2.13.0 (CPU build)"
pip_install torch==2.13.0
step "triton 3.7.1 and numpy"
pip_install triton==3.7.1 numpy
step "hypercache itself, editable, with the kernels and dev extras (grpcio, lmdb, typer, pytest ...)"
pip_install -e '.[kernels,dev]'
# Remote tier (docs/remote.md): the Mooncake Store client and the shared libraries it needs.
# Optional: without it `kvstore serve --remote` refuses with the reason and its tests skip.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1; then
    step "libibverbs1 librdmacm1 libnuma1 (apt; for the remote tier's Mooncake client)"
    { apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1; } >/dev/null 2>&1 \
      || step "apt-get could not install libibverbs1 librdmacm1 libnuma1: the remote tier may not start"
  fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then  # GPU hosts: the CUDA build of the same client
  step "mooncake-transfer-engine (the remote tier's client, CUDA build)"
  pip_install mooncake-transfer-engine || step "mooncake-transfer-engine did not install: remote tier off"
else
  step "mooncake-transfer-engine-non-cuda (the remote tier's client: the 'remote' extra)"
  pip_install -e '.[remote]' || step "the remote extra (mooncake) did not install: remote tier off"
fi
# A guard against an install that replaced the CPU torch with a CUDA build.
python - <<'PY'
import torch
assert torch.__version__.startswith(("2.11", "2.12", "2.13")), torch.__version__
print(f"setup: done: torch {torch.__version__}; run the tests with .venv/bin/python -m pytest -q, "
      "the demo with bash tools/demo.sh")
PY
