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
# A guard against an install that replaced the CPU torch with a CUDA build.
python - <<'PY'
import torch
assert torch.__version__.startswith(("2.11", "2.12", "2.13")), torch.__version__
print(f"setup: done: torch {torch.__version__}; run the tests with .venv/bin/python -m pytest -q, "
      "the demo with bash tools/demo.sh")
PY
