"""`tools/quality.py --model DIR` on tiny Hugging Face checkpoints (random weights, so the
scores mean nothing; what is pinned is that the command runs end to end): the table and
its JSON have the full / naive / PIC rows of each checkpoint; the requests went through
the checkpoint's chat template (prompt lengths of the rendering, written out here); a
sliding-window checkpoint gets the window rule's PIC row once its config is loaded;
`--no-chat` keeps the workloads' raw segments."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402
from engine.models.hf.tokenizer import CheckpointTokenizer  # noqa: E402
from tools.quality import parse_args, plan_jobs  # noqa: E402
from tools.workloads import iter_requests  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
QUICK = ["--quick", "--n", "2", "--seams", "4", "--no-progress"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    H.build("qwen3_5", root / "tiny-qwen3_5")
    H.build("gemma3", root / "tiny-gemma3")  # sliding window 8, <bos> in front
    return root / "tiny-qwen3_5", root / "tiny-gemma3"


def chat_prompt_tokens(d: Path) -> int:
    """Prompt positions of the --quick requests as the template renders them: <bos> when
    the tokenizer has one, `<|im_start|>user\\n`, each document alone, then the question
    with the template's tail."""
    tok = CheckpointTokenizer(d)
    total = 0
    for task in ("fact", "twohop"):
        for r in iter_requests(task, 2, 0, scale="tiny", docs="2-3", facts_per_doc=4):
            pieces = ["<|im_start|>user\n", *(s.text for s in r.segments[:-1]),
                      r.segments[-1].text + "<|im_end|>\n<|im_start|>assistant\n"]
            total += (tok.bos_id is not None) + sum(len(tok.encode(p)) for p in pieces)
    return total


def test_quality_model_writes_the_pic_vs_full_table_for_each_checkpoint(dirs, tmp_path):
    qwen, gemma = dirs
    out = tmp_path / "q.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tools/quality.py", *QUICK, "--model", str(qwen), "--model", str(gemma),
                           "--json", "--json-path", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pic s=4" in proc.stdout and "best PIC seam" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["config"]["models"] == [str(qwen), str(gemma)]
    assert doc["config"]["presets"] == [] and doc["config"]["chat"] is True
    assert [(r["model"], r["label"]) for r in doc["rows"]] == [
        (str(qwen), "full"), (str(qwen), "naive"), (str(qwen), "pic s=4"),
        (str(gemma), "full"), (str(gemma), "naive"), (str(gemma), "pic s=8 (window rule)"),
        (str(gemma), "pic s=4 (plain seam)")]
    for row in doc["rows"]:
        assert row["requests"] == 4 and row["weights"] == f"weights:{row['model']}"
        assert set(row["tasks"]) == {"fact", "twohop"} and row["kl"] >= 0.0
    full = doc["rows"][0]
    assert (full["kl"], full["top1"], full["recompute_fraction"]) == (0.0, 100.0, 1.0)
    assert doc["rows"][2]["reused_tokens"] > 0  # documents recur across the requests
    for d, row in ((qwen, doc["rows"][0]), (gemma, doc["rows"][3])):
        assert row["prompt_tokens"] == chat_prompt_tokens(d)
    assert set(doc["summary"]) == {str(qwen), str(gemma)}


def test_no_chat_keeps_the_raw_segments_and_bad_model_dirs_are_refused(dirs, tmp_path, capsys):
    qwen, _ = dirs
    (jobs, config) = plan_jobs(parse_args([*QUICK, "--model", str(qwen), "--no-chat"]))
    raw = [r for t in ("fact", "twohop") for r in iter_requests(t, 2, 0, scale="tiny", docs="2-3", facts_per_doc=4)]
    assert [j.preset for j in jobs] == [str(qwen)] and config["chat"] is False
    assert jobs[0].requests == tuple(raw)
    (chat_jobs, _) = plan_jobs(parse_args([*QUICK, "--model", str(qwen)]))
    assert chat_jobs[0].requests[0].segments[0].text == "<|im_start|>user\n"

    from tools.quality import main
    assert main([*QUICK, "--model", str(tmp_path)]) == 2  # no config.json
    assert f"--model {tmp_path}: not a Hugging Face checkpoint" in capsys.readouterr().err
