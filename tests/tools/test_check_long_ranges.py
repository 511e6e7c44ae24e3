"""tools/check_long_ranges_gpu.py dry-run on the CPU: the script's two parts run end to
end (on the CPU nothing is batched: the torch backend has no long-range special case,
so both settings must agree exactly) and it prints its table last. The batched path
itself is pinned on the CPU by tests/engine/pic/test_miss_path.py (fla emulated)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_on_the_cpu_checks_and_times_both_settings(tmp_path):
    out = tmp_path / "ranges.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "tools/check_long_ranges_gpu.py", "--device", "cpu", "--tiny",
                           "qwen3next-tiny", "--bench", "ring-tiny", "--docs", "4", "--doc-tokens", "200",
                           "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=str(REPO), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    (check,) = run["correctness"]
    assert check["miss_segments"] == 3 and check["max_abs_logit_diff"] == 0.0 and check["max_state_rel_diff"] == 0.0
    (row,) = run["timing"]
    assert row["miss_segments"] == 2 and row["hit_segments"] == 2
    assert row["batched_ms"] > 0 and row["per_range_ms"] > 0 and row["full_ms"] > 0
    assert row["max_abs_logit_diff"] == 0.0 and row["logit_abs_max"] > 0  # nothing batched on the CPU
    assert proc.stdout.strip().splitlines()[0].startswith("{")
    assert "| ring-tiny | 2/4 |" in proc.stdout
