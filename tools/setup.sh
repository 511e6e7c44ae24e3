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
# --- remote tier (issue 21): Mooncake Store client + its shared libraries -----------------
# Optional: without it `kvstore serve --remote` refuses with the reason and its tests skip.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 \
    || echo "setup: apt-get could not install libibverbs1 librdmacm1 libnuma1 (remote tier may not start)"
fi
if command -v nvidia-smi >/dev/null 2>&1; then  # GPU hosts: the CUDA build of the same client
  python -m pip install -q mooncake-transfer-engine || echo "setup: mooncake-transfer-engine did not install; remote tier off"
else
  python -m pip install -q -e '.[remote]' || echo "setup: the remote extra (mooncake) did not install; remote tier off"
fi
# --- end remote tier --------------------------------------------------------------------
# A guard against an install that replaced the CPU torch with a CUDA build.
python - <<'PY'
import torch
assert torch.__version__.startswith(("2.11", "2.12", "2.13")), torch.__version__
print(f"setup: torch {torch.__version__}, python ok")
PY
