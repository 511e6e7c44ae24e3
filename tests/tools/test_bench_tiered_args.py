"""tools/bench_tiered.py's command line: per-phase time limits, the daemon's GPU tier,
the PIC planner settings the flags reach (tools.servebench.tiered_phases.make_harness),
and per-workload request counts in the serve phase."""
from __future__ import annotations

import pytest


def test_phase_limits_parse_per_phase_or_for_every_phase_and_name_what_is_wrong():
    from tools.servebench.phase_clock import PhaseClock, parse_limits

    phases = ("serve", "pcie", "qps", "sweep")
    assert parse_limits("serve=240,qps=90.5", phases) == {"serve": 240.0, "qps": 90.5}
    assert parse_limits("300", phases) == dict.fromkeys(phases, 300.0)
    assert parse_limits(None, phases) == {}
    for bad, what in (("serv=3", "unknown phase 'serv'"), ("qps=x", "'x' is not a number"), ("qps=0", "> 0")):
        with pytest.raises(ValueError, match=what):
            parse_limits(bad, phases)
    clock = PhaseClock("qps", limit_s=1e-9)
    assert clock() == "time limit" and clock.record(complete=True)["stopped"] == "time limit"
    assert PhaseClock("qps")() is None and PhaseClock("qps", 3600.0)() is None


def test_the_serve_daemon_gpu_tier_is_the_flag_or_none_off_cuda():
    import torch

    from tools import bench_tiered

    args = bench_tiered.parse_args(["--quick"])
    assert bench_tiered.daemon_gpu_capacity(args, torch.device("cpu")) == "0"
    args = bench_tiered.parse_args(["--quick", "--gpu-capacity", "2GiB"])
    assert bench_tiered.daemon_gpu_capacity(args, torch.device("cpu")) == "2GiB"
    with pytest.raises(SystemExit):
        bench_tiered.parse_args(["--merge", "--phases", "serve"])  # --merge alone needs the --json file it keeps


def test_miss_path_signatures_exact_prefix_passes_and_cold_full_fraction_reach_pics_planner_config():
    from types import SimpleNamespace

    import torch

    from tools import bench_tiered
    from tools.servebench.tiered_phases import make_harness

    cpu = SimpleNamespace(device=torch.device("cpu"))  # make_harness reads the engine's device only
    h, _ = make_harness(bench_tiered.parse_args(["--quick"]), cpu, "/nonexistent.sock", sweep=False)
    assert (h.pic_config.miss_signatures, h.pic_config.cold_full_fraction) == ("alone", 0.5)
    args = bench_tiered.parse_args(["--quick", "--miss-signatures", "context", "--cold-full-fraction", "0.3"])
    h, _ = make_harness(args, cpu, "/nonexistent.sock", sweep=False)
    assert (h.pic_config.miss_signatures, h.pic_config.cold_full_fraction) == ("context", 0.3)
    assert h.pic_config.exact_prefix_passes == "all"
    h, _ = make_harness(bench_tiered.parse_args(["--quick", "--exact-prefix-passes", "repeated"]), cpu,
                        "/nonexistent.sock", sweep=False)
    assert h.pic_config.exact_prefix_passes == "repeated"
    assert (h.pic_config.idle_alone_passes, h.pic_config.idle_batch_tokens) == ("all", 16384)
    args = bench_tiered.parse_args(["--quick", "--idle-alone-passes", "repeated", "--idle-batch-tokens", "8192"])
    h, _ = make_harness(args, cpu, "/nonexistent.sock", sweep=False)
    assert (h.pic_config.idle_alone_passes, h.pic_config.idle_batch_tokens) == ("repeated", 8192)
    assert h.pic_config.miss_path == "context"
    args = bench_tiered.parse_args(["--quick", "--miss-path", "alone", "--cold-full-fraction", "off"])
    h, _ = make_harness(args, cpu, "/nonexistent.sock", sweep=False)
    assert (h.pic_config.miss_path, h.pic_config.cold_full_fraction) == ("alone", None)
    for bad in (["--cold-full-fraction", "0"], ["--cold-full-fraction", "1.5"], ["--cold-full-fraction", "x"],
                ["--miss-path", "alone", "--miss-signatures", "context"]):
        with pytest.raises(SystemExit):
            bench_tiered.parse_args(["--quick", *bad])


def test_n_workload_sets_the_requests_of_named_workloads_and_refuses_bad_items(monkeypatch):
    from tools import bench_tiered
    from tools.servebench import requests, tiered
    from tools.servebench.tiered_phases import serve_phase

    args = bench_tiered.parse_args(["--quick", "--workloads", "rag,repeat", "--n-workload", "repeat=10"])
    assert args.n_workload == {"repeat": 10} and args.n == 2
    for bad in ("repeat", "nosuch=3", "repeat=x", "repeat=0"):
        with pytest.raises(SystemExit):
            bench_tiered.parse_args(["--quick", "--n-workload", bad])
    loaded = []
    monkeypatch.setattr(requests, "load", lambda task, n, *a: loaded.append((task, n)) or [])
    warm = {"ttft_ms_mean": 1.0, "hits_by_source": {}, "breakdown": []}
    monkeypatch.setattr(tiered, "ttft_after_twin", lambda h, reqs, mark: {m: {"warm": warm} for m in
                                                                          ("full", "prefix", "pic")})
    monkeypatch.setattr(tiered, "format_hits", lambda hits: "")
    monkeypatch.setattr(tiered, "stored_by_tier", lambda h: {})
    monkeypatch.setattr(tiered, "break_even", lambda stored, workloads: {})
    monkeypatch.setattr(tiered, "signature_parts", lambda h: {})
    monkeypatch.setattr("tools.servebench.breakdown.mean_breakdown", lambda b: {
        k: 0.0 for k in ("lookup_ms", "restore_ms", "miss_ms", "forward_ms", "drain_ms", "other_ms")}
        | {"store_rpcs_per_request": 0, "host": {}})
    monkeypatch.setattr("tools.servebench.tiered_phases.format_host", lambda host: "")
    out = {"workloads": {}}
    serve_phase(args, None, None, out, lambda msg: None, lambda: None, lambda: False)
    assert loaded == [("rag", 2), ("repeat", 10)] and set(out["workloads"]) == {"rag", "repeat"}
