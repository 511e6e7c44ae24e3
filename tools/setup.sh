#!/usr/bin/env bash
# Creates .venv in the repository root and installs the project into it (idempotent).
# torch is pinned first to the local CPU build (2.13.0); the GPU box brings its own 2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q torch==2.13.0
python -m pip install -q triton==3.7.1 numpy
python -m pip install -q -e '.[kernels,dev]'
# A guard against an install that replaced the CPU torch with a CUDA build.
python - <<'PY'
import torch
assert torch.__version__.startswith(("2.11", "2.12", "2.13")), torch.__version__
print(f"setup: torch {torch.__version__}, python ok")
PY
