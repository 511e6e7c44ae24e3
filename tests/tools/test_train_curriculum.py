"""Tests of the loss-gated curriculum (tools/train/curriculum.py) and of how --parallel
spreads its children over GPUs (--gpus)."""
from __future__ import annotations

import pytest

from tools.train.curriculum import CurriculumGate, GateConfig
from tools.train.errors import TrainConfigError
from tools.train.train import build_parser, gpu_assignment, parse_gpus, train_config


def test_gate_holds_short_prompts_and_peak_lr_until_the_answer_loss_breaks():
    gate = CurriculumGate(GateConfig(threshold=1.0, tasks=("fact",), deadline=0.6, hold_level=0.2, ema=0.5), 0.25)
    assert gate.enabled and not gate.is_open
    assert gate.data_progress(0.3) == pytest.approx(0.25 * 0.2) and gate.lr_progress(0.3) == 0.0
    assert not gate.observe(10, 0.3, {"twohop": 0.1})  # other tasks do not open it
    assert not gate.observe(15, 0.3, {"fact": 2.9}) and gate.ema_loss == pytest.approx(2.9)
    assert not gate.observe(20, 0.3, {"fact": 0.5})  # EMA 1.7: still held
    assert gate.observe(25, 0.4, {"fact": 0.1})       # EMA 0.9 < 1.0: opens
    assert gate.is_open and gate.opened_step == 25 and "0.9" in gate.reason
    # from the opening on, data and lr progress run over the rest of the run
    assert gate.data_progress(0.4) == pytest.approx(0.05) and gate.lr_progress(0.4) == 0.0
    assert gate.data_progress(0.7) == pytest.approx(0.05 + 0.95 * 0.5) and gate.lr_progress(0.7) == pytest.approx(0.5)
    assert gate.data_progress(1.0) == pytest.approx(1.0) and gate.lr_progress(1.0) == pytest.approx(1.0)
    assert not gate.observe(30, 0.8, {"fact": 5.0}) and gate.opened_step == 25  # stays open


def test_gate_opens_at_its_deadline_and_is_transparent_when_off():
    gate = CurriculumGate(GateConfig(threshold=0.5, deadline=0.5), 0.3)
    assert not gate.observe(5, 0.49, {"fact": 2.8})
    assert gate.observe(10, 0.5, {"fact": 2.8}) and "deadline" in gate.reason
    off = CurriculumGate(GateConfig(), 0.3)
    assert off.is_open and off.data_progress(0.37) == 0.37 and off.lr_progress(0.37) == 0.37
    assert not off.observe(1, 0.1, {"fact": 0.0})


def test_bad_gate_options_are_named():
    with pytest.raises(TrainConfigError, match="curriculum_frac"):
        GateConfig(threshold=1.0).validate(0.0)
    with pytest.raises(TrainConfigError, match="deadline"):
        GateConfig(threshold=1.0, deadline=0).validate(0.3)
    args = build_parser().parse_args(["--preset", "gemma3-tiny", "--gate-loss", "1", "--gate-tasks", "nope"])
    with pytest.raises(TrainConfigError, match="nope"):
        train_config(args, "gemma3-tiny", 0)
    args = build_parser().parse_args(["--preset", "gemma3-tiny", "--gate-loss", "1.5", "--gate-tasks", "fact,twohop"])
    cfg = train_config(args, "gemma3-tiny", 0)
    assert cfg.gate.threshold == 1.5 and cfg.gate.tasks == ("fact", "twohop")


def test_parallel_children_are_spread_round_robin_over_the_gpus(monkeypatch):
    presets = ["qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny"]
    assert gpu_assignment(presets, ["0", "1"]) == {"qwen3next-tiny": "0", "ring-tiny": "1",
                                                   "gemma3-tiny": "0", "nemotronh-tiny": "1"}
    assert set(gpu_assignment(presets, ["3"]).values()) == {"3"}
    assert set(gpu_assignment(presets, None).values()) == {None}
    assert parse_gpus("0,1") == ["0", "1"] and parse_gpus("none") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert parse_gpus("auto") == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parse_gpus("auto") is None  # no GPU visible: children inherit the environment
    with pytest.raises(TrainConfigError, match="gpus"):
        parse_gpus("zero,one")


def test_training_run_opens_the_gate_when_the_loss_is_under_the_threshold_and_notes_a_missing_init(tmp_path):
    import json

    from tools.train.data import DataConfig
    from tools.train.trainer import GATE_EVERY, TrainConfig, train
    cfg = TrainConfig(preset="gemma3-tiny", out_dir=str(tmp_path), steps=GATE_EVERY + 1, batch_size=2,
                      warmup_steps=1, log_every=1, final_eval_n=1, final_eval_tasks=("fact",),
                      eval_overrides=(("docs", "2-3"), ("facts_per_doc", 4)),
                      model_overrides=(("hidden_size", 32), ("intermediate_size", 64), ("layers", ["full"])),
                      gate=GateConfig(threshold=50.0, tasks=("fact",)), init_from=str(tmp_path / "absent"),
                      data=DataConfig(mix={"fact": 1.0}, pad_multiple=32))
    assert train(cfg, command="test").ok
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["curriculum_gate"]["opened_at_step"] == GATE_EVERY and "< 50.0" in log["curriculum_gate"]["reason"]
    held = [h for h in log["history"] if h["step"] < GATE_EVERY]
    assert held and all(h["data_progress"] == pytest.approx(0.3 * 0.15) for h in held)
    assert log["history"][0]["lr"] == pytest.approx(cfg.lr)
    # --init-root over presets only some of which were trained: the others start from the init
    assert log["init_from"]["fingerprint"] is None and any("absent" in n for n in log["notes"])  # warmup of 1 step, cosine held at its peak
