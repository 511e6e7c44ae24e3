"""Tests of tools.train.fla_check and its use by the trainer: the gradient self-check passes
a path whose backward equals the torch path's, fails one whose backward is wrong (the
trainer then trains on torch and says so), lifting and restoring fla's Hopper guard flag.
fla needs CUDA, so the fla path is stood in for by the torch recurrence (monkeypatched
`fla_backend.fla_chunk`), exact or with a corrupted backward."""
from __future__ import annotations

import json

import pytest
import torch

from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import chunked_recurrence
from engine.models.weights import build_model
from tools.train import fla_check, trainer
from tools.train.data import BatchStream, DataConfig
from tools.train.trainer import TrainConfig, compute_loss, model_config

SMALL_HYBRID = (("hidden_size", 32), ("intermediate_size", 64), ("layers", ["gdn", "full"]))
SHORT_EVAL = (("docs", "2-3"), ("facts_per_doc", 4))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


def _exact_chunk(family, inp, state):
    return chunked_recurrence(family, inp, state, 64)


def _wrong_backward_chunk(family, inp, state):
    o, s = chunked_recurrence(family, inp, state, 64)
    return _ScaleGrad.apply(o), s


def _model_and_batch():
    cfg = TrainConfig(preset="qwen3next-tiny", out_dir="unused", model_overrides=SMALL_HYBRID)
    model = build_model(model_config(cfg), "cpu", torch.float32, seed=1)
    with BatchStream(DataConfig(mix={"fact": 1.0}, max_level=0.0, pad_multiple=32), 2, seed=5) as stream:
        batch = stream.peek(0.0)
        assert stream.next(0.0) is batch  # peek does not consume
    ids = torch.from_numpy(batch.ids[:, :128].astype("int64"))  # two 64-token chunks
    kinds = torch.from_numpy(batch.kinds[:, :128])
    return model, ids, kinds, lambda lg, i, k: compute_loss(lg, i, k, cfg.loss_weights).total


def test_check_passes_a_path_with_the_torch_gradients_and_fails_a_wrong_backward(monkeypatch):
    model, ids, kinds, loss_fn = _model_and_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(fla_backend, "fla_chunk", _exact_chunk)
    good = fla_check.check_backend_grads(model, ids, kinds, loss_fn, amp=torch.bfloat16)
    # an exact stand-in is exactly as far from the fp32 reference as the torch path under bf16
    assert good.ok and not good.failures and good.max_rel_err == pytest.approx(good.worst_param_noise)
    assert good.autocast == "bfloat16" and good.batch_shape == tuple(ids.shape) and good.top
    monkeypatch.setattr(fla_backend, "fla_chunk", _wrong_backward_chunk)
    bad = fla_check.check_backend_grads(model, ids, kinds, loss_fn, amp=None)
    assert not bad.ok and bad.max_rel_err > 0.1 and bad.loss_test == pytest.approx(bad.loss_ref, abs=1e-5)
    assert any(".mixer." in name for name in bad.failures), bad.failures
    assert "FAILED" in bad.summary()
    for n, p in model.named_parameters():  # weights untouched, grads cleared
        assert torch.equal(p, before[n]) and p.grad is None


def _run(tmp_path, monkeypatch, chunk, guard: bool):
    monkeypatch.setattr(fla_backend, "fla_chunk", chunk)
    monkeypatch.setattr(trainer, "resolve_backend", lambda requested, device: "fla")
    state = {"active": guard, "calls": []}
    monkeypatch.setattr(trainer, "hopper_guard_active", lambda: state["active"])

    def set_guard(active):
        state["calls"].append(active)
        state["active"] = active
    monkeypatch.setattr(trainer, "set_hopper_guard", set_guard)
    cfg = TrainConfig(preset="qwen3next-tiny", out_dir=str(tmp_path), steps=2, batch_size=2, warmup_steps=1,
                      log_every=1, final_eval_n=1, final_eval_tasks=("fact",), eval_overrides=SHORT_EVAL,
                      model_overrides=SMALL_HYBRID, fla_check_len=128,
                      data=DataConfig(mix={"fact": 1.0}, max_level=0.0, pad_multiple=32))
    result = trainer.train(cfg, command="test")
    return result, json.loads((tmp_path / "train_log.json").read_text()), state


def test_trainer_lifts_the_guard_and_keeps_fla_when_the_check_passes(tmp_path, monkeypatch):
    result, log, state = _run(tmp_path, monkeypatch, _exact_chunk, guard=True)
    assert result.ok and log["environment"]["backend"] == "fla" and log["final_eval"]["backend"] == "fla"
    assert log["fla_check"]["ok"] and log["fla_check"]["guard_lifted"] and state["calls"] == [False]
    assert log["fla_check"]["batch_shape"][0] == 2 and log["fla_check"]["batch_shape"][1] <= 128


def test_trainer_falls_back_to_torch_and_restores_the_guard_when_the_check_fails(tmp_path, monkeypatch):
    result, log, state = _run(tmp_path, monkeypatch, _wrong_backward_chunk, guard=True)
    assert result.ok and log["environment"]["backend"] == "torch" and log["final_eval"]["backend"] == "torch"
    assert not log["fla_check"]["ok"] and log["fla_check"]["failures"] and state["calls"] == [False, True]
    assert any("gradient check did not pass" in n for n in log["notes"])


def test_hopper_guard_flag_is_lifted_and_restored():
    pytest.importorskip("fla.ops.common.chunk_o", reason="fla-core not importable")
    mod = fla_check._guard_module()
    saved = getattr(mod, fla_check.GUARD_FLAG)
    try:
        fla_check.set_hopper_guard(False)
        assert getattr(mod, fla_check.GUARD_FLAG) is True and not fla_check.hopper_guard_active()
        fla_check.set_hopper_guard(True)
        assert getattr(mod, fla_check.GUARD_FLAG) is False
        # on a non-Hopper machine the guard never fires, whatever the flag says
        assert fla_check.hopper_guard_active() == bool(mod.IS_NVIDIA_HOPPER and mod.TRITON_ABOVE_3_4_0)
    finally:
        setattr(mod, fla_check.GUARD_FLAG, saved)
