#!/usr/bin/env bash
# The main job on a fresh machine: install (tools/setup.sh), start the kvstore daemon on
# its embedded defaults, show it working (inspect), run the demo twice (the second run is
# a new engine process that finds what the first one cached: exact prefixes, segments), then stop the
# daemon with SIGTERM (a graceful shutdown that flushes the LMDB index).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PY=.venv/bin/python
$PY -m kvstore.cli config
$PY -m kvstore.cli serve &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  $PY -m kvstore.cli inspect --json >/dev/null 2>&1 && break
  sleep 0.2
done
$PY -m kvstore.cli inspect
echo "== demo, first engine process (cold: segments computed and stored in the daemon)"
$PY tools/demo.py "$@"
echo "== demo, second engine process (warm: exact prefixes and segments loaded from the daemon)"
$PY tools/demo.py --last "$@"
$PY -m kvstore.cli inspect
