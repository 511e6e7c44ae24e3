"""tools.servebench.report.summarize on hand-made runs: the figures the serving issue
names, the best-baseline ratio, and a PIC that sustained no QPS rate counting as 0."""
from __future__ import annotations

from tools.servebench.report import summarize


def _state(ms: float) -> dict:
    return {"ttft_ms_mean": ms}


def _workload(full: float, prefix: float, pic: float) -> dict:
    return {"full": {"cold": _state(full), "warm": _state(full)},
            "prefix": {"cold": _state(prefix), "warm": _state(prefix)},
            "pic": {"cold": _state(full), "warm": _state(pic)}}


def _qps(prefix: float, pic: float) -> dict:
    return {"prefix": {"sustainable_qps": prefix}, "pic": {"sustainable_qps": pic}}


def test_ratios_against_each_baseline_and_the_faster_one():
    presets = {"a": {"workloads": {"w1": _workload(full=100.0, prefix=200.0, pic=25.0),  # prefix slower than full
                                   "w2": _workload(full=100.0, prefix=50.0, pic=25.0)}}}  # prefix reused a lot
    s = summarize(presets)
    assert s["ttft_reduction_vs_prefix_avg"] == (8.0 + 2.0) / 2
    assert s["ttft_reduction_vs_full_avg"] == 4.0
    assert s["ttft_reduction_vs_best_avg"] == (4.0 + 2.0) / 2  # never credits PIC for a slow baseline


def test_a_pic_that_sustained_no_rate_counts_as_zero_and_no_prefix_rate_is_left_out():
    presets = {"a": {"workloads": {}, "qps": _qps(prefix=2.0, pic=0.0)},
               "b": {"workloads": {}, "qps": _qps(prefix=1.0, pic=1.5)},
               "c": {"workloads": {}, "qps": _qps(prefix=0.0, pic=1.0)}}
    assert summarize(presets)["qps_gain_vs_prefix_at_slo"] == (0.0 + 1.5) / 2


def test_the_warm_cache_qps_gain_is_its_own_figure():
    presets = {"a": {"workloads": {}, "qps": dict(_qps(prefix=2.0, pic=3.0), warm=_qps(prefix=2.0, pic=8.0))},
               "b": {"workloads": {}, "qps": _qps(prefix=1.0, pic=1.0)}}  # a run without the warm state
    s = summarize(presets)
    assert s["qps_gain_vs_prefix_at_slo"] == (1.5 + 1.0) / 2
    assert s["qps_gain_vs_prefix_at_slo_warm"] == 4.0
    assert summarize({"c": {"workloads": {}}})["qps_gain_vs_prefix_at_slo_warm"] is None


def test_the_two_engine_ladder_stops_at_the_first_failing_rung():
    from tools.servebench.sharing import qps_at_slo

    trials = [{"rate": r, "ttft_ms_p99": p99} for r, p99 in ((2, 100.0), (4, 300.0), (8, 900.0), (16, 200.0))]
    got = qps_at_slo(trials, 500.0)
    assert got["sustainable_qps"] == 4 and got["passed"] == [True, True, False, True]  # 16 passing is noise
    assert qps_at_slo(trials[2:], 500.0)["sustainable_qps"] == 0.0
    assert qps_at_slo([{"rate": 2, "ttft_ms_p99": None}], 500.0)["sustainable_qps"] == 0.0


def test_the_ab_switches_parse_and_refuse_bad_values(capsys):
    import pytest

    from tools.bench_serving import parse_args

    args = parse_args([])
    assert (args.idle_resume, args.long_ranges, args.share_warm_pair) == ("on", "batched", "auto")
    assert (args.qps_idle, args.qps_trace_trial) == ("on", None)
    args = parse_args(["--idle-resume", "off", "--long-ranges", "per-range"])
    assert (args.idle_resume, args.long_ranges) == ("off", "per-range")
    with pytest.raises(SystemExit):
        parse_args(["--long-ranges", "all"])  # the scalar/diagonal batched form is gone
    assert "long-ranges" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--qps-idle", "maybe"])
    assert "qps-idle" in capsys.readouterr().err
    assert (parse_args([]).miss_path, parse_args([]).miss_signatures) == ("context", "alone")
    assert parse_args(["--miss-signatures", "context"]).miss_signatures == "context"
    with pytest.raises(SystemExit):
        parse_args(["--miss-signatures", "later"])
    assert "miss-signatures" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # context signatures come from misses computed in context
        parse_args(["--miss-path", "alone", "--miss-signatures", "context"])
    assert "--miss-signatures" in capsys.readouterr().err
