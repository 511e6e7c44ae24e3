"""tools/demo.py (what tools/demo.sh runs twice) against a REAL daemon, as a subprocess:
its closing lines say whether the daemon answered in words (not `store available:
True`), and the last run of a series (`--last`) does not tell the user to run it again;
the daemon then counts the demo's cold lookups as misses (its hit rate is not 100%)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kvstore.testing import REPO_ROOT, DaemonProcess


def test_demo_last_run_has_no_run_again_hint_and_the_daemon_counts_its_misses(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "KVSTORE_CONFIG": os.devnull}
    with DaemonProcess(tmp_path, cpu_capacity="64MiB", nvme_capacity="128MiB") as d:
        done = subprocess.run([sys.executable, "tools/demo.py", "--socket", str(d.socket), "--n", "1", "--last"],
                              capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "the daemon answered" in done.stdout
        assert "store available" not in done.stdout and "Run again" not in done.stdout
        stats = json.loads(d.cli("inspect", "--json").stdout)
    assert stats["lookup_misses"] >= 4 and stats["hit_rate"] < 1.0  # a cold run: its segments were misses
