"""The quality harness (tools/quality.py, tools/quality_measure.py) on small CPU configs:
full recomputation measured against itself is identical; PIC with a seam as wide as every
segment is full recomputation; naive addition is measurably off; answers of the `full`
method equal cache-free greedy generation; the table rows, summary and JSON schema.

The invariant tests use the seeded random init (`init_seed`), so they hold whether or not
trained weights sit under models/; the CLI test loads a saved checkpoint the way
`kvengine` loads models/<preset>/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.presets import get_preset
from engine.models.weights import build_model, save_model
from tools.quality import ModelJob, Reporter, main, run_jobs, summarize
from tools.quality_measure import MethodSpec, expand_specs, open_session, run_method
from tools.train.evaluate import encode_prompt, greedy_generate
from tools.workloads import iter_requests

REPO = Path(__file__).resolve().parents[2]
PRESET = "qwen3next-tiny"  # gated delta rule + conv + full attention: the hardest splice
TASKS = ("fact", "twohop")
FAMILIES = ("qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny", "gla-tiny")


def mean_kl(run) -> float:
    return sum(o.kl_sum for o in run.outcomes) / sum(o.positions for o in run.outcomes)


def top1_rate(run) -> float:
    return sum(o.top1_hits for o in run.outcomes) / sum(o.positions for o in run.outcomes)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one torch thread (as the harness does by
    default) is many times faster than two that spin against other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def requests():
    return [r for t in TASKS for r in iter_requests(t, 2, 0, docs="2-3", facts_per_doc=3, pool_size=6)]


@pytest.fixture(scope="module", params=FAMILIES)
def session(request, requests):
    max_tokens = max(r.prompt_tokens for r in requests) + 32
    return open_session(request.param, "cpu", max_tokens, batch_size=4, init_seed=0)


@pytest.fixture(scope="module")
def reference(session, requests):
    return run_method(session, MethodSpec("full"), requests, keep_logprobs=True)


def test_full_recompute_measured_against_itself_is_identical(session, requests, reference):
    again = run_method(session, MethodSpec("full"), requests, reference=reference.question_logprobs)
    assert [o.text for o in again.outcomes] == [o.text for o in reference.outcomes]
    assert [o.points for o in again.outcomes] == [o.points for o in reference.outcomes]
    assert all(o.kl_sum == 0.0 for o in again.outcomes)
    assert top1_rate(again) == 1.0
    assert all(o.positions > 0 and o.recomputed_tokens == o.prompt_tokens for o in again.outcomes)


def test_pic_with_a_seam_as_wide_as_every_segment_is_full_recompute(session, requests, reference):
    widest = max(len(s.text.encode()) for r in requests for s in r.segments)
    wide = run_method(session, MethodSpec("pic", widest, "seam"), requests, reference=reference.question_logprobs)
    assert mean_kl(wide) < 1e-6
    assert top1_rate(wide) == 1.0
    assert [o.text for o in wide.outcomes] == [o.text for o in reference.outcomes]
    assert [o.points for o in wide.outcomes] == [o.points for o in reference.outcomes]


def test_prefix_caching_reproduces_full_recompute(session, requests, reference):
    prefix = run_method(session, MethodSpec("prefix"), requests, reference=reference.question_logprobs)
    assert mean_kl(prefix) < 1e-6 and top1_rate(prefix) == 1.0
    assert [o.text for o in prefix.outcomes] == [o.text for o in reference.outcomes]


def test_naive_addition_differs_measurably_and_pic_is_closer(session, requests, reference):
    naive = run_method(session, MethodSpec("naive"), requests, reference=reference.question_logprobs)
    pic = run_method(session, MethodSpec("pic", 16, "seam"), requests, reference=reference.question_logprobs)
    # exact methods (prefix, a whole-segment seam) sit at ~1e-14 here; naive addition is
    # 2e-6 (random-init Mamba2 forgets fast) to 8e-3 (lightning) on random weights
    assert mean_kl(naive) > 1e-7
    assert mean_kl(pic) < mean_kl(naive)
    # later requests hit signatures that earlier ones computed (one planner across the run)
    assert sum(o.reused_tokens for o in naive.outcomes[1:]) > 0
    assert sum(o.recomputed_tokens for o in naive.outcomes) < sum(o.prompt_tokens for o in naive.outcomes)


def test_full_method_answers_equal_cache_free_greedy_generation(session, requests, reference):
    prompts = [encode_prompt(r.prompt) for r in requests]
    gens = greedy_generate(session.loaded.model, prompts, max_new=6, backend="torch")
    assert [o.token_ids[:6] for o in reference.outcomes] == gens


def test_swa_models_get_the_window_rule_and_duplicate_rows_are_measured_once():
    gemma = expand_specs(get_preset("gemma3-tiny"), ["full", "naive", "pic"], [0, 8, 200], ["window", "seam"])
    assert gemma == [MethodSpec("full"), MethodSpec("naive"), MethodSpec("pic", 128, "window"),
                     MethodSpec("pic", 200, "window"), MethodSpec("pic", 0, "seam"), MethodSpec("pic", 8, "seam")]
    qwen = expand_specs(get_preset(PRESET), ["pic", "prefix"], [0, 16], ["window", "seam"])
    assert qwen == [MethodSpec("full"), MethodSpec("pic", 0), MethodSpec("pic", 16), MethodSpec("prefix")]


def test_each_state_dtype_repeats_the_pic_and_naive_rows_and_names_itself():
    specs = expand_specs(get_preset(PRESET), ["naive", "pic", "prefix"], [16], ["window"], ["float32", "bfloat16"])
    assert specs == [MethodSpec("full"), MethodSpec("naive"), MethodSpec("pic", 16), MethodSpec("prefix"),
                     MethodSpec("naive", state_dtype="bfloat16"), MethodSpec("pic", 16, state_dtype="bfloat16")]
    assert specs[-1].label == "pic s=16 bfloat16 states" and specs[-1].pic_config().state_dtype == "bfloat16"
    assert specs[2].pic_config().state_dtype == "float32"  # the table's rows pin float32 unless asked


def _row(method, seam, avg, recompute, model="m"):
    return {"model": model, "weights": "init", "method": method, "seam": seam, "swa_seam": None, "avg": avg,
            "avg_delta": avg - 80.0, "kl": 0.0, "top1": 100.0, "recompute_fraction": recompute}


def test_best_pic_seam_is_the_cheapest_within_tolerance_else_the_closest():
    rows = [_row("full", None, 80.0, 1.0), _row("naive", None, 40.0, 0.2), _row("pic", 0, 70.0, 0.25),
            _row("pic", 16, 79.5, 0.4), _row("pic", 64, 80.0, 0.8)]
    s = summarize(rows, tolerance=1.0)["m"]
    assert (s["best_pic_seam"], s["best_pic_avg_delta"], s["best_pic_within_tolerance"]) == (16, -0.5, True)
    assert (s["full_avg"], s["naive_avg_delta"], s["prefix_avg_delta"]) == (80.0, -40.0, None)
    s = summarize(rows, tolerance=0.1)["m"]
    assert s["best_pic_seam"] == 64
    s = summarize(rows[:4], tolerance=0.1)["m"]
    assert (s["best_pic_seam"], s["best_pic_within_tolerance"]) == (16, False)


def test_quick_run_on_saved_weights_writes_the_table_and_json_rows_and_summary(tmp_path):
    """The CLI as the lead runs it once trained checkpoints sit under models/<preset>/
    (here a saved seeded model under KVENGINE_MODELS_DIR)."""
    save_model(build_model(get_preset(PRESET), "cpu", torch.float32, seed=3), tmp_path / "models" / PRESET)
    out = tmp_path / "q.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KVENGINE_MODELS_DIR=str(tmp_path / "models"))
    proc = subprocess.run([sys.executable, "tools/quality.py", "--quick", "--n", "2", "--json", "--json-path",
                           str(out), "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "pic s=16" in proc.stdout and "best PIC seam 16" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and not out.with_name(out.name + ".tmp").exists()
    assert doc["schema"] == "quality/v1" and doc["command"].startswith("python -m tools.quality --quick")
    assert doc["config"]["tasks"] == ["fact", "twohop"] and doc["config"]["n"] == 2
    assert [(r["model"], r["method"], r["seam"]) for r in doc["rows"]] == [
        (PRESET, "full", None), (PRESET, "naive", None), (PRESET, "pic", 16)]
    for row in doc["rows"]:
        assert set(row["tasks"]) == set(TASKS)
        for t in row["tasks"].values():
            assert set(t) == {"n", "score", "delta", "kl", "top1", "positions"} and t["n"] == 2
            assert 0.0 <= t["score"] <= 100.0 and t["kl"] >= 0.0 and 0.0 <= t["top1"] <= 100.0
        assert row["avg_delta"] == pytest.approx(row["avg"] - doc["rows"][0]["avg"])
        assert row["requests"] == 4 and row["ms_per_request"] > 0 and row["prompt_tokens"] > 0
    full = doc["rows"][0]
    assert (full["kl"], full["top1"], full["avg_delta"], full["recompute_fraction"]) == (0.0, 100.0, 0.0, 1.0)
    summary = doc["summary"][PRESET]
    assert summary["weights"] == f"weights:{tmp_path / 'models' / PRESET}"
    assert summary["full_avg"] == full["avg"] and summary["best_pic_seam"] == 16
    assert summary["naive_avg_delta"] == doc["rows"][1]["avg_delta"]
    assert summary["best_pic_avg_delta"] == doc["rows"][2]["avg_delta"]


def test_models_measured_in_parallel_workers_give_the_serial_rows(requests):
    reqs = tuple(requests[:2])
    jobs = [ModelJob(p, tuple(expand_specs(get_preset(p), ["naive"], [], ["window"])), reqs, ("fact",), "cpu",
                     max(r.prompt_tokens for r in reqs) + 32, 2, 1, 0) for p in ("ring-tiny", "gla-tiny")]
    finished: list[list[str]] = []  # each model's rows reach on_model as soon as that model is done
    serial = run_jobs(jobs, Reporter(), parallel=1, on_model=lambda rows: finished.append([r["model"] for r in rows]))
    assert finished == [["ring-tiny", "ring-tiny"], ["gla-tiny", "gla-tiny"]]
    finished.clear()
    parallel = run_jobs(jobs, Reporter(), parallel=2, on_model=lambda rows: finished.append([r["model"] for r in rows]))
    assert sorted(finished) == [["gla-tiny", "gla-tiny"], ["ring-tiny", "ring-tiny"]]
    keys = ("model", "method", "tasks", "avg", "kl", "top1", "recomputed_tokens")
    assert [[r[k] for k in keys] for r in parallel] == [[r[k] for k in keys] for r in serial]
    assert [r["model"] for r in serial] == ["ring-tiny", "ring-tiny", "gla-tiny", "gla-tiny"]


@pytest.mark.parametrize("argv, named", [
    (["--methods", "full,bogus"], "'bogus'"),
    (["--tasks", "fact,nope"], "'nope'"),
    (["--presets", "nope-tiny"], "'nope-tiny'"),
    (["--seams", "8,x"], "'x'"),
    (["--swa-seam", "wide"], "'wide'"),
    (["--state-dtypes", "float32,float8"], "'float8'"),
    (["--n", "0"], "--n 0"),
    (["--jobs", "0"], "--jobs 0"),
])
def test_bad_options_exit_2_naming_the_bad_value(argv, named, capsys):
    assert main(argv + ["--no-progress", "--device", "cpu"]) == 2
    assert named in capsys.readouterr().err
