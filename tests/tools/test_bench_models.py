"""tools/bench_models.py: --quick runs every phase's real code on the CPU (scaled-down
real-shape presets in process, `kvengine serve` as a subprocess until /v1/models
answers) and writes its JSON; the FLOP count takes only the active experts; a phase past
its limit is recorded as skipped, not guessed."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from engine.models.presets import get_preset
from tools import bench_models
from tools.bench_models import Budget, Report, flop_model, main, run_phase


@pytest.fixture
def own_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path / "xdg" / "hypercache" / "triton"
    torch.set_num_threads(threads)


def test_quick_run_measures_every_phase_of_both_presets(tmp_path, own_kernel_cache, capsys):
    out = tmp_path / "models.json"
    assert main(["--quick", "--lengths", "16", "--batches", "1", "--time-budget-s", "240", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["quick"] is True
    assert set(doc["presets"]) == set(bench_models.REAL_PRESETS)
    for name, res in doc["presets"].items():
        assert res["parameters"] > 0 and res["dense_flops_per_token"] > 0
        assert res["load"]["load_s"] > 0 and res["load"]["dtype"] == "torch.float32"
        assert res["memory"]["kv_bytes_per_token"] > 0 and res["memory"]["state_bytes_per_sequence"] > 0
        pre = res["prefill"]["16"]
        assert pre["tokens_per_s"] > 0 and pre["seconds"] > 0
        assert pre["flops"]["total"] > pre["flops"]["dense"] > 0 and pre["flops"]["attention"] > 0
        assert pre["mfu_spec"] > 0 and pre["mfu_matmul"] > pre["mfu_spec"] and pre["mfu_dense_spec"] < pre["mfu_spec"]
        assert res["decode"]["1"]["tokens_per_s"] > 0
    ready = doc["presets"]["qwen3.5-35b-a3b-real"]["ready"]["cold"]
    assert ready["ready_s"] >= ready["listening_s"] > 0 and ready["models"] == ["qwen3next-tiny"]
    assert "--kernel-cache" in ready["command"] and "--prefill-graphs idle" in ready["command"]
    assert ready["prefill_graphs_mode"] == "idle" and ready["graphs_ready_s"] >= ready["ready_s"]
    assert ready["graphs_at_ready"]["mode"] == "idle" and ready["graphs_final"]["ready"] is True  # CPU: no stages
    assert 0 < ready["breakdown"]["model_load_s"] < ready["ready_s"]  # from the serve log (no graphs on the CPU)
    assert "wrote" in capsys.readouterr().out


def test_flops_count_the_active_experts_only():
    cfg = get_preset("qwen3.5-35b-a3b-real")
    base = flop_model(cfg)
    d, i, layers = cfg.hidden_size, cfg.moe.intermediate_size, cfg.num_layers
    one_more = flop_model(cfg.replace(moe=replace(cfg.moe, top_k=cfg.moe.top_k + 1)))
    assert one_more.dense_per_token - base.dense_per_token == layers * 2 * 3 * d * i
    more_experts = flop_model(cfg.replace(moe=replace(cfg.moe, num_experts=cfg.moe.num_experts + 1)))
    assert more_experts.dense_per_token - base.dense_per_token == layers * 2 * d  # one router column
    assert 2.5e9 < base.dense_per_token / 2 + cfg.hidden_size * cfg.vocab_size < 3.5e9  # "A3B"
    assert base.lm_head_per_row == 2 * d * cfg.vocab_size


def test_prefill_flops_attention_is_quadratic_and_the_rest_linear():
    fm = flop_model(get_preset("ring-mini-linear-2.0-real"))
    a, b = fm.prefill(4096), fm.prefill(8192)
    assert b["attention"] == 4 * a["attention"]
    assert b["linear"] == 2 * a["linear"]
    assert b["dense"] - fm.lm_head_per_row == 2 * (a["dense"] - fm.lm_head_per_row)


def test_serve_log_timings_reads_the_builder_lines(caplog):
    import logging

    import torch

    from engine.runtime.prefill_graphs import PrefillGraphWarmup, PrefillStages

    with caplog.at_level(logging.INFO, logger="engine.runtime"):  # the line the engine itself logs
        PrefillGraphWarmup(PrefillStages(torch.device("cpu"), buckets=(32, 64), capture=False), lambda b: None, "upfront")
    (line,) = [r.getMessage() for r in caplog.records if "prefill-stage graphs ready" in r.getMessage()]
    text = ("x INFO engine.builder: loaded model q (init:seed=0) on cuda/torch.bfloat16 in 4.25 s\n"
            f"x INFO engine.runtime: {line}\n")
    got = bench_models.serve_log_timings(text)
    assert got["model_load_s"] == 4.25 and got["prefill_graphs"] == 0 and 0 <= got["prefill_graph_capture_s"] < 1


def test_a_phase_past_its_limit_is_recorded_as_skipped(tmp_path):
    report = Report(tmp_path / "r.json", {"tool": "test"})
    where: dict = {}
    assert run_phase(report, where, "slow", 0.2, Budget(60), lambda: time.sleep(5) or {}) is None
    assert where["slow"]["skipped"].startswith("timed out")
    assert run_phase(report, where, "late", 10, Budget(0), lambda: {"x": 1}) is None
    assert "time budget spent" in where["late"]["skipped"]
    got = run_phase(report, where, "ok", 10, Budget(60), lambda: {"x": 1})
    assert got == where["ok"] and got["x"] == 1 and got["phase_s"] >= 0
    assert json.loads((tmp_path / "r.json").read_text())["presets"] == {}


def test_a_serve_that_exits_before_listening_is_reported_with_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="no preset named 'no-such-preset'"):
        bench_models.ready_time("no-such-preset", tmp_path / "k", True, 60)
