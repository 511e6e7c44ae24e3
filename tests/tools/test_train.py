"""Tests of tools.train: training sequences (loss classes, extra questions that a solver
agrees with, padding, reproducible batches across worker processes), the loss, greedy
full-recompute generation, a short CPU run that lowers the loss and saves a checkpoint the
engine reloads with the same fingerprint, and the CLI."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.models.weights import build_model, load_model
from tools.train.data import (ANSWER_KIND, DEMO_KIND, PAD_ID, PAD_KIND, PROMPT_KIND, QUESTION_KIND, BatchStream, DataConfig, build_group,
                              collate, encode_request, example_config, make_example, parse_mix)
from tools.train.errors import TrainConfigError
from tools.train.evaluate import decode_answer, encode_prompt, eval_requests, evaluate, greedy_generate
from tools.train.questions import QA, extra_questions, parse_examples, parse_facts
from tools.train.trainer import TrainConfig, compute_loss, lr_at, model_config, train
from tools.workloads import TASKS, make_config, sample_training_request
from tools.workloads.fewshot import consistent_answers

ROOT = Path(__file__).resolve().parents[2]
#: a two-layer gemma3-shaped model: fast on the CPU, has both attention kinds
SMALL = (("hidden_size", 32), ("intermediate_size", 64), ("layers", ["swa", "full"]))
SHORT_EVAL = (("docs", "2-3"), ("facts_per_doc", 4))


def _text(ids: np.ndarray) -> str:
    return bytes(int(i) for i in ids).decode()


def _spans(ex, kind: int) -> list[str]:
    """Maximal runs of tokens of one loss class, as text."""
    out, cur = [], []
    for i, k in zip(ex.ids.tolist(), ex.kinds.tolist()):
        if k == kind:
            cur.append(i)
        elif cur:
            out.append(bytes(cur).decode())
            cur = []
    if cur:
        out.append(bytes(cur).decode())
    return out


# ------------------------------------------------------------------------ data
def test_encoded_example_marks_bos_prompt_and_answers():
    rng = random.Random(3)
    req = sample_training_request("fact", rng)
    extras = [QA("Q: value of abcd?\nA: ", "wxyz")]
    ex = encode_request(req, extras, bos=True)
    assert ex.ids[0] == 256 and ex.kinds[0] == PAD_KIND
    assert _spans(ex, ANSWER_KIND) == [req.answer + "\n", "wxyz\n"]
    assert _spans(ex, QUESTION_KIND) == [req.segments[-1].text, "Q: value of abcd?\nA: "]
    assert _spans(ex, PROMPT_KIND) == ["".join(seg.text for seg in req.segments[:-1])]
    assert _text(ex.ids[1:]) == req.prompt + req.answer + "\nQ: value of abcd?\nA: wxyz\n"
    no_bos = encode_request(req, (), bos=False)
    assert no_bos.ids[0] != 256 and len(no_bos) == len(req.prompt) + len(req.answer) + 1


def test_fewshot_demonstration_outputs_are_their_own_loss_class():
    req = sample_training_request("fewshot", random.Random(4))
    ex = encode_request(req, (), bos=True)
    examples = parse_examples(req)
    assert _spans(ex, DEMO_KIND) == [o + "\n" for _, o in examples]
    assert _spans(ex, ANSWER_KIND) == [req.answer + "\n"]
    assert _text(ex.ids[1:]) == req.prompt + req.answer + "\n"
    assert all(i + " -> " in "".join(_spans(ex, PROMPT_KIND)) for i, _ in examples)
    assert _spans(ex, QUESTION_KIND) == [req.segments[-1].text]


@pytest.mark.parametrize("task", TASKS)
def test_extra_questions_are_answered_correctly_from_the_prompt(task):
    rng = random.Random(11)
    asked = 0
    for _ in range(15):
        req = sample_training_request(task, rng)
        qas = extra_questions(req, rng, 3)
        facts = dict(parse_facts(req))
        own = req.segments[-1].text
        for qa in qas:
            assert qa.question.startswith("Q: ") and qa.question.endswith("\nA: ") and qa.question != own
            q = qa.question[3:-4]
            if q.startswith("value of value of "):
                middle = facts[q[len("value of value of "):-1]]
                assert f"{middle}: {facts[middle]}" == qa.answer
            elif q.startswith("value of "):
                assert facts[q[len("value of "):-1]] == qa.answer
            elif q.startswith("which keys are "):
                cat = q[len("which keys are "):-1]
                assert qa.answer == " ".join(k for k, v in parse_facts(req) if v == cat)
            else:
                assert task == "fewshot"
                examples = parse_examples(req)
                assert q not in {i for i, _ in examples}
                assert consistent_answers(examples, q) == {qa.answer}
            asked += 1
        assert len({qa.question for qa in qas}) == len(qas)
    assert asked >= 15 * 2, f"too few extra questions for {task}: {asked}"


def test_make_example_respects_max_len_and_mixture():
    cfg = DataConfig(mix={"twohop": 1.0}, max_len=400, extra_questions=3)
    rng = random.Random(0)
    exs = [make_example(rng, cfg, progress=0.0) for _ in range(30)]
    assert all(len(e) <= 400 and e.task == "twohop" for e in exs)
    assert all((e.kinds == ANSWER_KIND).sum() >= 5 for e in exs)


def test_curriculum_levels_shrink_prompts_and_full_level_is_the_default_config():
    assert example_config("fact", 1.0) == make_config("fact", "tiny")
    small = example_config("fact", 0.0)
    assert small.docs_min == small.docs_max == 2 and small.facts_per_doc == 3
    cfg = DataConfig(mix={"fact": 1.0}, extra_questions=0, curriculum_frac=0.3)
    rng = random.Random(1)
    first = [len(make_example(rng, cfg, 0.0)) for _ in range(20)]
    early = np.mean([len(make_example(rng, cfg, 0.15)) for _ in range(40)])
    late = [len(make_example(rng, cfg, 0.6)) for _ in range(40)]
    assert max(first) < 140  # 2 documents of 3 facts and the question
    assert max(first) < early < 0.75 * np.mean(late)
    assert min(late) >= len("## doc 1\n") * 3 + 11 * 3 * 9  # every prompt has the full 3-7 docs of 11 facts


def test_collate_pads_to_multiple_with_pad_ids_and_no_loss():
    rng = random.Random(2)
    cfg = DataConfig(mix={"fewshot": 1.0})
    exs = [make_example(rng, cfg, 1.0) for _ in range(3)]
    batch = collate(exs, 128)
    assert batch.ids.shape[1] % 128 == 0 and batch.ids.shape[1] >= max(len(e) for e in exs)
    for i, e in enumerate(exs):
        assert (batch.ids[i, len(e):] == PAD_ID).all() and (batch.kinds[i, len(e):] == PAD_KIND).all()
        assert (batch.ids[i, :len(e)] == e.ids).all()


def test_batch_stream_is_reproducible_in_process_and_in_worker_processes():
    cfg = DataConfig(mix={"fact": 1.0, "fewshot": 1.0}, max_level=0.0)
    with BatchStream(cfg, batch_size=3, seed=5, workers=0, group=2) as a, \
            BatchStream(cfg, batch_size=3, seed=5, workers=1, group=2, prefetch=2) as b:
        for _ in range(5):
            x, y = a.next(0.5), b.next(0.5)
            assert x.tasks == y.tasks
            np.testing.assert_array_equal(x.ids, y.ids)
            np.testing.assert_array_equal(x.kinds, y.kinds)
    one = build_group(9, cfg, 3, 2, 0.0)
    two = build_group(9, cfg, 3, 2, 0.0)
    assert [b.ids.tobytes() for b in one] == [b.ids.tobytes() for b in two]


def test_bad_data_options_are_named():
    with pytest.raises(TrainConfigError, match="nope"):
        parse_mix("fact=1,nope=2")
    with pytest.raises(TrainConfigError, match="max_level"):
        DataConfig(max_level=2.0).validate()
    with pytest.raises(TrainConfigError, match="lr"):
        TrainConfig(preset="gemma3-tiny", out_dir="x", lr=0).validate()


# ------------------------------------------------------------------------ loss
def test_loss_weights_each_token_class_and_ignores_padding():
    ids = torch.tensor([[256, 10, 11, 12, 13, 14, 258]])
    kinds = torch.tensor([[PAD_KIND, PROMPT_KIND, QUESTION_KIND, ANSWER_KIND, ANSWER_KIND, DEMO_KIND, PAD_KIND]])
    logits = torch.zeros(1, 7, 260)
    # perfect on the answer targets (positions 2, 3 predict ids 12, 13), uniform elsewhere
    logits[0, 2, 12] = logits[0, 3, 13] = 50.0
    uniform = math.log(260)
    parts = compute_loss(logits, ids, kinds, {})
    assert parts.answer.item() < 1e-6 and parts.total.item() < 1e-6
    assert parts.answer_count.item() == 2 and parts.answer_correct.item() == 2
    assert parts.by_kind["prompt"].item() == pytest.approx(uniform, rel=1e-5)
    weighted = compute_loss(logits, ids, kinds, {"prompt": 0.5, "question": 0.25, "demo": 2.0})
    assert weighted.total.item() == pytest.approx((0.5 + 0.25 + 2.0) * uniform, rel=1e-5)
    # padding targets never count, whatever the logits say there
    logits[0, 5, :] = torch.randn(260) * 100
    again = compute_loss(logits, ids, kinds, {"prompt": 0.5, "question": 0.25, "demo": 2.0})
    assert again.total.item() == pytest.approx(weighted.total.item())


def test_lr_warms_up_then_follows_cosine_to_min():
    cfg = TrainConfig(preset="gemma3-tiny", out_dir="x", lr=1e-3, warmup_steps=10, min_lr_frac=0.1)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 500, 0.5) == pytest.approx(0.55e-3)
    assert lr_at(cfg, 1000, 1.0) == pytest.approx(1e-4)


# ------------------------------------------------------------------ generation
def _small_model(seed: int = 0):
    cfg = model_config(TrainConfig(preset="gemma3-tiny", out_dir="x", model_overrides=SMALL))
    return build_model(cfg, "cpu", torch.float32, seed=seed)


def test_batched_greedy_generation_equals_one_prompt_at_a_time_and_stops_at_newline():
    model = _small_model(1)
    with torch.no_grad():  # make the model emit newlines often, so stopping is exercised
        model.embed.weight[ord("\n")] *= 8
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(97, 123) for _ in range(n)] for n in (5, 17, 9)]
    batched = greedy_generate(model, prompts, max_new=6, batch_size=8, pad_multiple=8)
    alone = [greedy_generate(model, [p], max_new=6)[0] for p in prompts]
    assert batched == alone
    for gen in batched:
        assert all(t != ord("\n") for t in gen[:-1]) and len(gen) <= 6
    # the reference: append argmax of the full forward one token at a time
    ids = torch.tensor(prompts[1])
    for tok in alone[1]:
        nxt = int(model(ids[None])[0, -1].argmax())
        assert nxt == tok
        ids = torch.cat([ids, torch.tensor([nxt])])


def test_evaluate_scores_each_task_with_the_workload_metric():
    model = _small_model()
    reqs = eval_requests(["fact", "aggregate"], 2, seed=0, **dict(SHORT_EVAL))
    res = evaluate(model, reqs, batch_size=2, max_new=6)
    assert set(res) == {"fact", "aggregate"} and all(r.n == 2 for r in res.values())
    assert all(0.0 <= r.score <= 100.0 for r in res.values())
    assert encode_prompt("ab") == [256, 97, 98] and decode_answer([97, 256, 10]) == "a\n"


# ---------------------------------------------------------------------- training
def test_short_cpu_training_lowers_loss_and_saves_a_reloadable_checkpoint(tmp_path):
    out = tmp_path / "models" / "gemma3-tiny-custom"
    cfg = TrainConfig(preset="gemma3-tiny", out_dir=str(out), steps=25, batch_size=4, lr=3e-3, warmup_steps=3,
                      log_every=1, final_eval_n=2, final_eval_tasks=("fact",), eval_overrides=SHORT_EVAL,
                      model_overrides=SMALL,
                      data=DataConfig(mix={"fact": 1.0}, max_level=0.0, extra_questions=2))
    result = train(cfg, command="test")
    assert result.ok and result.steps == 25
    log = json.loads((out / "train_log.json").read_text())
    first = np.mean([h["loss"] for h in log["history"][:3]])
    last = np.mean([h["loss"] for h in log["history"][-3:]])
    assert last < first - 1.0, (first, last)
    assert log["command"] == "test" and log["steps"] == 25 and "fact" in log["final_eval"]["scores"]
    assert (out / "model.safetensors").stat().st_size < 16 * 2**20
    loaded = load_model(out)
    assert loaded.trained and loaded.fingerprint == result.fingerprint == log["fingerprint"]
    # the engine's default lookup: <models_root>/<name>/
    by_name = load_model("gemma3-tiny", models_root=tmp_path / "models")
    assert not by_name.trained  # a custom config is saved under its own name, not the preset's
    assert loaded.config.name == "gemma3-tiny-custom"
    # continuing from the checkpoint starts from those weights (one step of lr 1e-12 moves them by ~1e-12)
    again = train(dataclasses.replace(cfg, out_dir=str(tmp_path / "again"), steps=1, lr=1e-12, warmup_steps=0,
                                      init_from=str(out)), command="test")
    before, after = loaded.model.state_dict(), load_model(tmp_path / "again").model.state_dict()
    assert again.ok and before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=1e-9, rtol=0)
    assert json.loads((tmp_path / "again" / "train_log.json").read_text())["init_from"]["fingerprint"] \
        == result.fingerprint


def test_cli_trains_bundles_and_rejects_bad_options(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tools.train", "--presets", "gemma3-tiny", "--out-root", str(tmp_path / "m"),
           "--bundle-dir", str(tmp_path / "b"), "--steps", "2", "--batch", "2", "--final-eval-n", "1",
           "--final-eval-tasks", "fact", "--eval-overrides", json.dumps(dict(SHORT_EVAL)), "--max-level", "0",
           "--model-overrides", json.dumps(dict(SMALL)), "--workers", "0"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gemma3-tiny" in done.stdout and "fact" in done.stdout
    # --model-overrides: saved as <preset>-custom, so load_model("gemma3-tiny") never picks it up
    with tarfile.open(tmp_path / "b" / "gemma3-tiny-custom.tar") as tar:
        assert sorted(tar.getnames()) == ["gemma3-tiny-custom/config.json", "gemma3-tiny-custom/model.safetensors",
                                          "gemma3-tiny-custom/train_log.json"]
    assert not load_model("gemma3-tiny", models_root=tmp_path / "m").trained
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["rows"][0]["preset"] == "gemma3-tiny" and summary["rows"][0]["steps"] == 2
    bad = subprocess.run([sys.executable, "-m", "tools.train", "--preset", "nope-tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope-tiny" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "tools.train", "--preset", "gemma3-tiny", "--mix", "fact=x"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "fact" in bad.stderr
