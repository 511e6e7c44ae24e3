"""`kvengine run` as users run it, over a small saved model (byte vocabulary): the JSON
record contract, reuse across requests in another order, every method's accounting,
the wide-seam PIC output equal to full recompute, the table, and bad input rejected by
name. One subprocess run pins the real command line; the rest run in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.cli import app
from engine.models.config import FULL, GDN, SWA
from engine.models.weights import build_model, save_model
from pic_testlib import pic_config

ROOT = Path(__file__).resolve().parents[3]
REQUIRED = {"id", "text", "prompt_tokens", "reused_tokens", "recomputed_tokens", "ttft_ms"}
DOCS = ["## doc 1\nab12: cd34\nef56: gh78\n", "## doc 2\nij90: kl12\nmn34: op56\n",
        "## doc 3\nqr78: st90\nuv12: wx34\n"]


def _line(rid, docs, question):
    return json.dumps({"id": rid, "segments": [{"text": d, "cache": True} for d in docs]
                       + [{"text": question, "cache": False}], "task": "fact"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    save_model(build_model(pic_config([GDN, SWA, FULL], name="pic-run-test"), "cpu", torch.float32, seed=1), d)
    return d


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("req") / "requests.jsonl"
    f.write_text("\n".join([
        _line("r1", DOCS, "Q: value of ij90?\nA: "),
        _line("r2", DOCS[::-1], "Q: value of qr78?\nA: "),
        "",
        _line("r3", DOCS[:2], "Q: value of ab12?\nA: "),
    ]) + "\n")
    return f


def run_in_process(*args):
    result = CliRunner().invoke(app, ["run", *map(str, args)])
    return result


def records(result):
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]


def test_run_command_line_prints_one_json_record_per_request(model_dir, requests_file):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--preset", str(model_dir), "--requests",
                           str(requests_file), "--method", "pic", "--seam", "4", "--max-new-tokens", "3", "--json",
                           "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["id"] for r in recs] == ["r1", "r2", "r3"]
    for r in recs:
        assert REQUIRED <= r.keys()
        assert r["method"] == "pic" and r["output_tokens"] == len(r["text"].encode()) or r["output_tokens"] == 3
    r1, r2, r3 = recs
    assert r1["reused_tokens"] == 0 and r1["miss_segments"] == 3
    assert r2["hit_segments"] == 3 and r2["miss_segments"] == 0  # same documents, another order
    assert r2["reused_tokens"] + r2["recomputed_tokens"] == r2["prompt_tokens"]
    assert r3["hit_segments"] == 2 and r3["reused_tokens"] > 0


def test_every_method_reports_its_reuse(model_dir, requests_file):
    by_method = {}
    for method in ("full", "prefix", "naive", "pic"):
        by_method[method] = records(run_in_process("--preset", model_dir, "--requests", requests_file, "--method",
                                                   method, "--seam", 4, "--max-new-tokens", 2, "--json"))
    assert all(r["reused_tokens"] == 0 and r["recomputed_tokens"] == r["prompt_tokens"] for r in by_method["full"])
    p1, p2, p3 = by_method["prefix"]
    assert p2["reused_tokens"] == 0  # another order: no common prefix
    # prefix caching keeps r1's states only at the end of its cacheable prefix (and at branch
    # points): r3 shares r1's first two documents but cannot resume there; it leaves a branch point
    assert p3["reused_tokens"] == 0
    n1, n2, _ = by_method["naive"]
    assert n2["seam_tokens"] == 0 and n2["reused_tokens"] == n2["prompt_tokens"] - len("Q: value of qr78?\nA: ")
    c2 = by_method["pic"][1]
    assert c2["seam_tokens"] == 6 + 6  # SWA window 6 > seam 4: the window policy
    assert c2["reused_tokens"] == n2["reused_tokens"] - 12


def test_pic_with_a_seam_as_wide_as_every_segment_answers_like_full_recompute(model_dir, requests_file):
    full = records(run_in_process("--preset", model_dir, "--requests", requests_file, "--method", "full",
                                  "--max-new-tokens", 4, "--json"))
    pic = records(run_in_process("--preset", model_dir, "--requests", requests_file, "--method", "pic",
                                 "--seam", 64, "--max-new-tokens", 4, "--json"))
    assert [r["text"] for r in pic] == [r["text"] for r in full]
    assert pic[1]["reused_tokens"] == 0  # doc 3 was never first before: a miss, computed alone
    assert pic[2]["reused_tokens"] == 1 + len(DOCS[0])  # only a first segment is ever spliced


def test_table_output_names_the_method_and_the_reuse(model_dir, requests_file):
    result = run_in_process("--preset", model_dir, "--requests", requests_file, "--method", "naive",
                            "--max-new-tokens", 1)
    assert result.exit_code == 0, result.output
    assert "method=naive" in result.output and "prompt tokens reused" in result.output


def test_bad_input_is_rejected_naming_the_line_and_field(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line("ok", DOCS[:1], "Q?") + '\n{"id": "x", "segments": [{"text": 5}]}\n')
    result = run_in_process("--preset", model_dir, "--requests", bad, "--method", "pic")
    assert result.exit_code == 2 and "bad.jsonl:2.segments[0].text" in result.output
    result = run_in_process("--preset", model_dir, "--requests", bad, "--method", "magic")
    assert result.exit_code == 2 and "method" in result.output and "magic" in result.output
    settings = tmp_path / "pic.toml"
    settings.write_text('[pic]\nstate_dtype = "int8"\n')
    result = run_in_process("--preset", model_dir, "--requests", bad, "--pic-config", settings)
    assert result.exit_code == 2 and "pic.state_dtype" in result.output and "int8" in result.output
    result = run_in_process("--preset", model_dir, "--requests", tmp_path / "missing.jsonl", "--method", "pic")
    assert result.exit_code == 2 and "missing.jsonl" in result.output
