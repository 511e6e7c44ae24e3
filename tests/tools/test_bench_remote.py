"""tools/bench_remote.py end to end at toy sizes (a real mooncake_master and holder
process on loopback): it writes the JSON with every side, the overheads and the target
verdict. The figures mean nothing at this size; the full run is in docs/results/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.remote.testing import mooncake_unavailable

ROOT = Path(__file__).resolve().parents[2]
_WHY = mooncake_unavailable()


def _bench(tmp_path, *args: str) -> dict:
    """tools/bench_remote.py run with `args` in a process of its own; its JSON."""
    out_path = tmp_path / "remote.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_remote.py"), *args, "--out", str(out_path)],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_path.read_text())


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_bench_remote_writes_every_side_and_the_overhead_verdict(tmp_path):
    d = _bench(tmp_path, "--sizes", "1", "--repeats", "1", "--iters", "3", "--read-chunk", str(256 << 10))
    (row,) = d["rows"]
    assert row["size_mib"] == 1 and set(row) >= {"mooncake", "mooncake_verified", "ours", "overhead"}
    # our get reads the object in 256 KiB pieces here: the raw client reads the same pieces beside it
    assert d["read_chunk_bytes"] == 256 << 10 and "mooncake_ranged" in row
    assert "get_paired_median_pct_vs_ranged" in row["overhead"]
    for side in ("mooncake", "mooncake_verified", "mooncake_ranged", "ours"):
        assert row[side]["get_p50_ms"]["median"] > 0 and row[side]["put_gbps"]["median"] > 0
    steps = row["ours_steps_ms"]  # where our time goes, per step
    assert set(steps) == {"put_encode", "put_call", "get_call", "get_verify"} and min(steps.values()) > 0
    assert d["summary"]["target_met"] == (d["summary"]["worst_p50_latency_overhead_pct"] <= 10.0)
    assert "shared" in d["machine"]["note"] and "--out" in d["command"]


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_bench_remote_pairs_a_second_piece_rule_on_the_same_client(tmp_path):
    """`--alt-read-split`: a side `ours_alt` with another read_split, its overheads paired
    against the raw client and against ours; at 4 MiB the default reads two pieces, the
    alternative (read_split 8 MiB) one get."""
    d = _bench(tmp_path, "--sizes", "4", "--repeats", "1", "--iters", "2", "--alt-read-split", str(8 << 20))
    (row,) = d["rows"]
    assert d["read_split_bytes"] == 3 << 20 and d["alt_read_split_bytes"] == 8 << 20
    size = row["alt_piece_bytes"]  # the alternative's one get: the whole object with its trailer
    assert size > 4 << 20 and 2 * row["piece_bytes"] >= size > row["piece_bytes"]
    assert row["ours_alt"]["get_p50_ms"]["median"] > 0 and "mooncake_ranged" in row
    per = d["summary"]["per_size_paired_overhead_pct"]["4"]
    assert {"get_alt", "put_alt", "get_alt_vs_ours", "get_alt_vs_verified"} <= set(per)
    assert set(row["ours_alt_steps_ms"]) == {"put_encode", "put_call", "get_call", "get_verify"}
