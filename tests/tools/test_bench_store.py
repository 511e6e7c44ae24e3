"""tools/bench_store.py end to end at toy sizes (real daemon, real files): it prints every
data-plane row, the NVMe read rows included, with a ratio against the direct-I/O
baseline. The figures themselves mean nothing at this size; the GPU box measures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_store_prints_the_nvme_read_rows_against_the_direct_io_baseline(tmp_path):
    pytest.importorskip("rich", reason="the row parsing below reads the rich table (plain text without rich)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_store.py"), "--size", "1MiB", "--count", "2",
         "--cold-repeat", "1", "--lookup-iterations", "20", "--dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("│")[2].strip(): line for line in out.stdout.splitlines() if line.count("│") > 6}
    for op in ("get (cold, no promote)", "get (cold, no promote), daemon-verified",
               "get (cold, no promote), via .array", "get (cold, promote to cpu)"):
        cells = [c.strip() for c in rows[op].split("│")]
        assert cells[4] == "direct-I/O read" and float(cells[5]) > 0 and float(cells[6]) > 0, rows[op]
    assert "client-verified" in rows["get (cold, no promote)"]
    assert ("get (cold, no promote) into GPU tensor" in rows) == _cuda()
    # the NVMe read backends side by side: posix always, kvikio only where it imports with CUDA
    posix = [c.strip() for c in rows["read (posix: O_DIRECT + pinned + H2D)" if _cuda() else
                                     "read (posix: O_DIRECT)"].split("│")]
    assert float(posix[3]) > 0, posix
    assert not any(p.name.startswith("run-") for p in tmp_path.iterdir()), "the run directory was left behind"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
