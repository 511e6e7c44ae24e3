"""`kvengine` as users run it: `python -m engine.cli ...` in a subprocess (presets,
generate, serve), and in-process through typer's CliRunner where only the command's
logic matters (bad options, bench, JSON output). The presets JSON schema, generate on a
tiny preset (text equals the engine's greedy output), bad options rejected by name,
bench's report, `run` with context signatures (through --pic-config), and serve
answering over HTTP until SIGTERM."""
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.builder import EngineConfig, build_engine
from engine.cli import app
from engine.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def kvengine_in_process(*args):
    return CliRunner().invoke(app, list(args))


def kvengine(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_presets_json_lists_name_family_scale_and_layer_pattern():
    res = kvengine("presets", "--json")
    assert res.returncode == 0, res.stderr
    presets = json.loads(res.stdout)
    assert isinstance(presets, list) and presets
    for p in presets:
        assert isinstance(p["name"], str) and isinstance(p["family"], str)
        assert p["scale"] in ("tiny", "bench")
        assert p["layers"] and all(isinstance(kind, str) for kind in p["layers"])
    names = [p["name"] for p in presets]
    assert len(names) == len(set(names))
    for family in {p["family"] for p in presets}:
        assert {p["scale"] for p in presets if p["family"] == family} == {"tiny", "bench"}


def test_generate_prints_the_greedy_text_and_timings():
    res = kvengine_in_process("generate", "--preset", "ring-tiny", "Once upon a time", "--max-new-tokens", "6", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    engine = build_engine("ring-tiny", EngineConfig(device="cpu", dtype="float32", max_num_seqs=1))
    (expected,) = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=6))
    assert out["text"] == expected.text
    assert out["prompt_tokens"] == expected.num_prompt_tokens and out["output_tokens"] == len(expected.token_ids)
    assert out["ttft_ms"] > 0
    plain = kvengine("generate", "--preset", "ring-tiny", "Once upon a time", "--max-new-tokens", "6")
    assert plain.returncode == 0 and plain.stdout.rstrip("\n") == expected.text
    assert re.search(r"prompt tokens: \d+ .*TTFT: [0-9.]+ ms .*decode: [0-9.]+ tokens/s", plain.stderr)


@pytest.mark.parametrize(
    "args, named",
    [
        (["generate", "--preset", "ring-tiny", "hi", "--top-p", "3"], "--top-p"),
        (["generate", "--preset", "no-such-preset", "hi"], "no-such-preset"),
        (["generate", "--preset", "ring-tiny", "hi", "--dtype", "float8"], "--dtype"),
        (["bench", "--preset", "ring-tiny", "--request-rate", "-1"], "--request-rate"),
        (["bench", "--preset", "ring-tiny", "--max-batch", "8", "--max-batched-tokens", "4"], "--max-batched-tokens"),
        (["serve", "--preset", "ring-tiny", "--seam", "4"], "--seam"),  # PIC options need --store (serve)
        (["run", "--preset", "ring-tiny", "--requests", "unread.jsonl", "--seam", "-1"], "--seam"),
        (["run", "--preset", "ring-tiny", "--requests", "unread.jsonl", "--pic-config", "/nonexistent/pic.toml"],
         "--pic-config"),
        (["bench", "--preset", "ring-tiny", "--host-threads", "0"], "--host-threads"),
    ],
)
def test_bad_options_exit_2_naming_the_option(args, named):
    res = kvengine_in_process(*args)
    assert res.exit_code == 2, res.output
    assert named in res.stderr


DOCS = ["## doc 1\nk1aa: v1aa\nk1bb: v1bb\nk1cc: v1cc\nk1dd: v1dd\n",
        "## doc 2\nk2aa: v2aa\nk2bb: v2bb\nk2cc: v2cc\nk2dd: v2dd\n"]


def test_run_with_context_signatures_reuses_what_the_first_request_computed_in_context(tmp_path):
    """miss_signatures = "context" (--pic-config): the first request's misses are computed
    in its own pass and their signatures taken from it (captured, none queued for an idle
    alone pass); the second, the same documents in the other order, reuses them."""
    requests = tmp_path / "requests.jsonl"
    lines = [{"id": rid, "segments": [{"text": DOCS[i], "cache": True} for i in order]
              + [{"text": "Q: value of k2bb?\nA: ", "cache": False}]} for rid, order in (("a", (0, 1)), ("b", (1, 0)))]
    requests.write_text("".join(json.dumps(r) + "\n" for r in lines))
    settings = tmp_path / "pic.toml"
    settings.write_text('[pic]\nmiss_signatures = "context"\n')
    res = kvengine_in_process("run", "--preset", "qwen3next-tiny", "--requests", str(requests), "--method", "pic",
                              "--pic-config", str(settings), "--max-new-tokens", "2", "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    first, second = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert first["reused_tokens"] == 0 and first["miss_segments"] == 2
    assert first["captured_segments"] == 2 and first["deferred_segments"] == 0
    assert second["hit_segments"] == 2 and second["reused_tokens"] > 0 and second["captured_segments"] == 0


def test_bench_reports_ttft_percentiles_and_throughput():
    res = kvengine_in_process("bench", "--preset", "gla-tiny", "--num-requests", "3", "--prompt-len", "16",
                              "--max-new-tokens", "4", "--max-batch", "2", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["num_requests"] == 3 and rep["output_tokens"] == 12 and rep["prompt_tokens"] == 48
    assert 0 < rep["ttft_ms_p50"] <= rep["ttft_ms_p99"]
    assert rep["output_tokens_per_s"] > 0 and rep["requests_per_s"] > 0


def test_serve_answers_over_http_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--preset", "gemma3-tiny", "--port", "0", "--max-batch", "2",
         "--kv-cache-tokens", "512", "--device", "cpu"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = m.group(1)
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            assert json.loads(resp.read())["model"] == "gemma3-tiny"
        req = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "hi", "max_tokens": 3, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = json.loads(resp.read())
        assert body["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0


# ---------------------------------------------------------------- issue 22: what a new user trips on


def _requests_file(path, *requests):
    path.write_text("".join(json.dumps({"id": rid, "segments": segs}) + "\n" for rid, segs in requests))
    return path


def test_run_refuses_a_request_without_tokens_before_computing_anything(tmp_path):
    reqs = _requests_file(tmp_path / "reqs.jsonl", ("a", [{"text": DOCS[0], "cache": True}]),
                          ("b", [{"text": DOCS[1], "cache": True}]), ("hollow", [{"text": "", "cache": True}]))
    res = kvengine("run", "--preset", "qwen3next-tiny", "--requests", str(reqs), "--device", "cpu")
    assert res.returncode == 2 and res.stdout == ""  # nothing ran
    assert res.stderr.strip() == ("kvengine: error: --requests: reqs.jsonl:3.segments: request hollow has no tokens "
                                  "(every segment's text is empty)")


def test_run_refuses_a_request_too_long_for_the_model_before_computing_anything(tmp_path):
    reqs = _requests_file(tmp_path / "reqs.jsonl", ("short", [{"text": DOCS[0], "cache": True}]),
                          ("huge", [{"text": "x" * 70000, "cache": False}]))
    res = kvengine("run", "--preset", "qwen3next-tiny", "--requests", str(reqs), "--device", "cpu")
    assert res.returncode == 2 and res.stdout == "", res.stdout
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvengine: error: --requests: reqs.jsonl:2 (id huge): prompt:"), err


def test_run_table_streams_rows_shows_fused_ms_and_reports_warm_up_apart(tmp_path):
    reqs = _requests_file(tmp_path / "reqs.jsonl",
                          *[(rid, [{"text": DOCS[i], "cache": True}, {"text": "Q: k1bb?\nA: ", "cache": False}])
                            for rid, i in (("first", 0), ("second", 1), ("third", 0))])
    res = kvengine("run", "--preset", "qwen3next-tiny", "--requests", str(reqs), "--device", "cpu",
                   "--max-new-tokens", "1", timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = next(line for line in lines if line.startswith("id "))
    assert "fused ms" in header and "load ms" not in header and "suffix ms" not in header
    rows = [line.split()[0] for line in lines[lines.index(header) + 1:] if line.split()[0] in ("first", "second", "third")]
    assert rows == ["first", "second", "third"]
    assert "over requests 2-3 (the first, with warm-up:" in res.stdout
    step = tmp_path / "step.toml"  # the step-by-step plan computes misses alone
    step.write_text('[pic]\nfused = false\nmiss_path = "alone"\n')
    res = kvengine("run", "--preset", "qwen3next-tiny", "--requests", str(reqs), "--device", "cpu",
                   "--max-new-tokens", "1", "--pic-config", str(step), timeout=300)
    assert res.returncode == 0 and "load ms" in res.stdout and "fused ms" not in res.stdout


def test_errors_carry_the_kvengine_prefix_and_help_is_plain():
    res = kvengine("run", "--preset", "qwen3next-tiny", "--requests", "/nonexistent/reqs.jsonl")
    assert res.returncode == 2
    assert res.stderr.strip() == "kvengine: error: --requests: cannot read /nonexistent/reqs.jsonl: " \
                                 "No such file or directory"
    res = kvengine("generate", "--preset", "no-such-preset", "hi")
    assert res.returncode == 2 and res.stderr.startswith("kvengine: error: no preset named 'no-such-preset'")
    res = kvengine("run", "--preset", "qwen3next-tiny", "--requests", "x.jsonl", "--method", "magic")
    assert res.returncode == 2 and res.stderr.strip() == ("kvengine: error: --method: 'magic' must be one of full, "
                                                          "prefix, naive, pic")
    helptext = kvengine("run", "--help").stdout
    assert "--seam N" in helptext and "<int>" not in helptext and "<bool>" not in helptext
    assert "\u2502" not in helptext  # no rich boxes cut at 80 columns
