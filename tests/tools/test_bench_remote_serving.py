"""tools/bench_remote_serving.py: the two-daemon serving case end to end on the CPU
(`--quick`: a real mooncake_master, two real daemons with --remote, one tiny engine):
host 2 serves the segments host 1 computed from the remote tier, confirmed by its remote
hit counters, and the JSON has the TTFT summary; and the pre-flight, where Mooncake does
not import, says why in one line and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.remote.testing import mooncake_unavailable

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_remote_serving.py"
_WHY = mooncake_unavailable()


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_host_two_serves_host_one_segments_from_the_remote_tier_faster_than_recompute(tmp_path):
    out_path = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(TOOL), "--quick", "--n", "1", "--repeats", "1", "--warmup", "off",
                          "--json", str(out_path)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out_path.read_text())
    assert "skipped" not in d
    assert d["compute"]["host1_remote"]["objects_written"] > 0 and d["compute"]["host1_remote"]["put_errors"] == 0
    (rep,) = d["repeats_done"]
    (remote,) = rep["remote"]
    # the remote tier served: daemon 2 filled the segments from it, then loaded them from its CPU tier
    assert remote["remote_hits"] >= 1 and remote["remote_bytes_read"] > 0 and remote["remote_errors"] == 0
    assert remote["hit_segments"] == remote["remote_hits"] and remote["miss_segments"] == 0
    assert remote["hits_by_tier"]["cpu"] == remote["hit_segments"] and remote["reused_tokens"] > 0
    assert rep["recompute"][0]["reused_tokens"] == 0
    s = d["summary"]
    assert s["remote_served"] is True and s["remote_hits_total"] == remote["remote_hits"]
    assert s["remote_ttft_ms"] == remote["ttft_ms"] and s["recompute_ttft_ms"] == rep["recompute"][0]["ttft_ms"]
    assert s["ttft_vs_recompute"] == pytest.approx(s["remote_ttft_ms"] / s["recompute_ttft_ms"])
    assert "remote" in out.stdout and str(out_path) in out.stdout


def test_preflight_without_mooncake_says_why_in_one_line_and_exits_0(tmp_path):
    stub = tmp_path / "stub" / "mooncake"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "store.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    out_path = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "stub"), str(ROOT)]))
    out = subprocess.run([sys.executable, str(TOOL), "--quick", "--json", str(out_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_remote_serving: skipped:") and "libibverbs" in lines[0]
    assert "libibverbs" in json.loads(out_path.read_text())["skipped"]


def test_carry_without_a_wheel_names_what_is_missing(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("BENCH_REMOTE_SERVING_CARRIED", None)
    out = subprocess.run([sys.executable, str(TOOL), "--quick", "--carry", str(tmp_path), "--json",
                          str(tmp_path / "x.json")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no mooncake_transfer_engine*.whl" in out.stderr
