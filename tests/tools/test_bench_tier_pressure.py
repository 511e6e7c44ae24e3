"""tools/bench_tier_pressure.py end to end on small objects: two real daemons (write-back
off, then on), the JSON run and the table printed last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_both_modes_run_and_only_the_on_mode_writes_back(tmp_path):
    out = tmp_path / "pressure.json"
    proc = subprocess.run([sys.executable, "tools/bench_tier_pressure.py", "--dir", str(tmp_path / "d"), "--size",
                           "1MiB", "--objects", "6", "--puts", "4", "--rate", "20", "--json", str(out)],
                          capture_output=True, text=True, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    off, on = run["rows"]
    assert off["watermark"] == 1.0 and off["writebacks"] == 0 and off["demotions"] == 4
    assert on["watermark"] == 0.5 and on["writebacks"] >= 3  # half the filled tier, before the puts
    for r in (off, on):
        assert len(r["put_ms"]) == 4 and r["lookups"] > 0 and r["evictions"] == 0
    assert proc.stdout.strip().splitlines()[-1].startswith("ratios off / on:")
