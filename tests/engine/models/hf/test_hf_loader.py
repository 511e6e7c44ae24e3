"""Hugging Face checkpoint directories as users give them: the `generate --model` contract
(raw text, greedy, `text` / `token_ids` / `prompt_tokens`), the checkpoint's tokenizer
(segments tokenized one by one behind the tokenizer's own BOS, chat template rendered as
transformers renders it, stop tokens from generation_config.json), and configs the
engine cannot run refused with the field named."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    model, ids = H.build("qwen3_5", d)
    return model, d, ids


@pytest.fixture(scope="module")
def with_bos(tmp_path_factory):
    """A checkpoint whose tokenizer puts <bos> in front of every default encoding."""
    d = tmp_path_factory.mktemp("qwen3_5-bos")
    model, ids = H.build("qwen3_5", d, with_bos=True, seed=3)
    return model, d, ids


def kvengine(*args, timeout=300):
    """`python -m engine.cli ARGS` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)


def kvengine_in_process(*args):
    """The command in this process (typer's CliRunner): same code, no interpreter start-up."""
    from typer.testing import CliRunner

    from engine.cli import app

    res = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)


@pytest.mark.parametrize("fixture", ["qwen", "with_bos"])
def test_generate_model_json_is_greedy_over_the_default_encoding(request, fixture):
    model, d, _ = request.getfixturevalue(fixture)
    from engine.models.hf.tokenizer import CheckpointTokenizer

    tok = CheckpointTokenizer(d)
    n = 8
    run = kvengine if fixture == "qwen" else kvengine_in_process
    proc = run("generate", "--model", str(d), H.PROMPT, "--max-new-tokens", str(n), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    prompt_ids = tok.encode_default(H.PROMPT)
    assert out["prompt_tokens"] == len(prompt_ids)
    _, _, ref = H.reference_greedy(model, prompt_ids, n - 1)
    got = out["token_ids"]
    assert got == ref[:len(got)]
    assert len(got) == n or got[-1] in tok.stop_ids
    assert out["text"] == tok.decode(got)


def test_generate_chat_renders_the_checkpoint_template(with_bos):
    from transformers import PreTrainedTokenizerFast

    _, d, _ = with_bos
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(d))
    expected = hf_tok.apply_chat_template([{"role": "user", "content": "hello cache"}], tokenize=True,
                                          add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    proc = kvengine_in_process("generate", "--model", str(d), "hello cache", "--chat", "--max-new-tokens", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["prompt_tokens"] == len(expected)


def test_chat_template_renders_as_transformers_does(with_bos):
    from transformers import PreTrainedTokenizerFast

    from engine.models.hf.tokenizer import CheckpointTokenizer

    _, d, _ = with_bos
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ours = CheckpointTokenizer(d)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(d))
    text = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(msgs) == text
    ids = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert [ours.bos_id] + ours.encode(ours.chat_prompt(msgs)) == list(ids)


@pytest.mark.parametrize("fixture", ["qwen", "with_bos"])
def test_segments_are_tokenized_one_by_one_behind_the_tokenizers_own_bos(request, fixture):
    from engine.builder import EngineConfig, build_engine

    _, d, ids = request.getfixturevalue(fixture)
    engine = build_engine(str(d), EngineConfig(device="cpu", dtype="float32", max_num_seqs=2, kv_cache_tokens=512))
    tok = engine.tokenizer
    assert tok.bos_id == (ids["<bos>"] if fixture == "with_bos" else None)
    anchor = [] if tok.bos_id is None else [tok.bos_id]

    def tokenized(segs):
        rid = engine.add_request([{"text": s, "cache": True} for s in segs])
        req = engine.get_request(rid)
        engine.abort(rid)
        return req.prompt_token_ids, req.segments

    segs = ["Retrieved documents", ", tool outputs", " and hello world"]
    token_ids, segments = tokenized(segs)
    assert token_ids[:len(anchor)] == anchor
    for text, seg in zip(segs, segments):
        assert token_ids[seg.token_start:seg.token_end] == tok.encode(text)  # alone, no specials
    assert token_ids == anchor + sum((tok.encode(s) for s in segs), [])
    # the same segment at another offset has the same ids; one segment is the default encoding
    token_ids2, segments2 = tokenized([segs[2]])
    assert token_ids2[segments2[0].token_start:] == tok.encode(segs[2])
    assert token_ids2 == tok.encode_default(segs[2])


def test_older_config_spellings_map_to_the_same_model(qwen, tmp_path):
    from engine.models.hf import convert_checkpoint

    _, d, _ = qwen

    def legacy(c):
        c.pop("layer_types")
        c["full_attention_interval"] = 4
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]  # partial_rotary_factor: the 0.25 default
        c["use_sliding_window"] = False

    old = _edited_copy(d, tmp_path / "old", legacy)
    assert convert_checkpoint(old).config.replace(name="x") == convert_checkpoint(d).config.replace(name="x")


def test_stop_tokens_come_from_generation_config(qwen):
    from engine.models.hf.tokenizer import CheckpointTokenizer
    from engine.runtime.sampling import SamplingParams, check_stop

    _, d, ids = qwen
    tok = CheckpointTokenizer(d)
    assert tok.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert tok.eos_id == ids["<|im_end|>"]
    params = SamplingParams(max_new_tokens=10)
    assert check_stop(params, ids["<|endoftext|>"], 1, tok.stop_ids) == "stop"
    assert check_stop(SamplingParams(max_new_tokens=10, ignore_eos=True), ids["<|endoftext|>"], 1,
                      tok.stop_ids) is None


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(some_new_feature=3), "some_new_feature"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(model_type="llama4"), "model_type"),
])
def test_unsupported_config_is_refused_naming_the_field(qwen, tmp_path, edit, named):
    from engine.errors import ConfigError
    from engine.models.hf import load_hf_model

    _, d, _ = qwen
    bad = _edited_copy(d, tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=named):
        load_hf_model(bad)


def test_cli_model_errors_name_the_option(qwen, tmp_path):
    _, d, _ = qwen
    both = kvengine_in_process("generate", "--model", str(d), "--preset", "qwen3next-tiny", "hi", "--json")
    assert both.returncode == 2 and "--preset/--model" in both.stderr
    missing = kvengine_in_process("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert missing.returncode == 2 and "--model" in missing.stderr
    bad = _edited_copy(d, tmp_path / "bad", lambda c: c.update(some_new_feature=3))
    refused = kvengine_in_process("generate", "--model", str(bad), "hi")
    assert refused.returncode == 2 and "some_new_feature" in refused.stderr


def test_serve_model_answers_completions_with_the_checkpoints_greedy_text(qwen):
    import re
    import signal
    import urllib.request

    from engine.models.hf.tokenizer import CheckpointTokenizer

    model, d, _ = qwen
    tok = CheckpointTokenizer(d)
    prompt_ids = tok.encode_default(H.PROMPT)
    _, _, ref = H.reference_greedy(model, prompt_ids, 3)
    stop = next((i for i, t in enumerate(ref) if t in tok.stop_ids), None)
    want = ref if stop is None else ref[:stop + 1]
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(d), "--port", "0",
                             "--max-batch", "2", "--kv-cache-tokens", "512", "--device", "cpu"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        req = urllib.request.Request(m.group(1) + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": H.PROMPT, "max_tokens": 4, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            body = json.loads(resp.read())
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
        assert body["choices"][0]["text"] == tok.decode(want)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_run_and_bench_take_a_model_directory(qwen, tmp_path):
    _, d, _ = qwen
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join(json.dumps({"id": f"q{i}", "segments": H.segments(order)})
                              for i, order in enumerate([(0, 1, 2), (2, 1, 0)])) + "\n")
    run = kvengine_in_process("run", "--model", str(d), "--requests", str(reqs), "--method", "pic",
                              "--max-new-tokens", "2", "--json", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    by_id = {r["id"]: r for r in records if "id" in r}
    assert by_id["q0"]["reused_tokens"] == 0 and by_id["q1"]["reused_tokens"] > 0
    bench = kvengine_in_process("bench", "--model", str(d), "--num-requests", "2", "--prompt-len", "8",
                                "--max-new-tokens", "2", "--json", "--device", "cpu")
    assert bench.returncode == 0, bench.stderr
    rep = json.loads(bench.stdout.strip().splitlines()[-1])
    assert rep["preset"] == str(d) and rep["num_requests"] == 2


def test_damaged_checkpoints_are_refused_naming_the_part(qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.errors import WeightsError
    from engine.models.hf import load_hf_model

    _, d, _ = qwen
    extra = tmp_path / "extra"
    shutil.copytree(d, extra)
    tensors = load_file(str(extra / "model.safetensors"))
    save_file({**tensors, "model.layers.0.mlp.mystery.weight": tensors["model.norm.weight"].clone()},
              str(extra / "model.safetensors"))
    with pytest.raises(WeightsError, match="mystery"):
        load_hf_model(extra)
    missing = tmp_path / "missing"
    shutil.copytree(d, missing)
    tensors.pop("model.norm.weight")
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(WeightsError, match="model.norm.weight"):
        load_hf_model(missing)
    shard = tmp_path / "shard"
    shutil.copytree(d, shard)
    (shard / "model.safetensors").rename(shard / "model-00001-of-00002.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        load_hf_model(shard)
    (shard / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="config.json"):
        load_hf_model(shard)


def test_streamed_text_joins_to_the_decoded_text(qwen):
    from engine.models.hf.tokenizer import CheckpointTokenizer

    _, d, ids = qwen
    tok = CheckpointTokenizer(d)
    text = "hello world, héllo ünïcode 0 1 2 \u2603"
    token_ids = tok.encode(text) + [ids["<|im_end|>"]]
    dec = tok.stream_decoder()
    pieces = [dec.push(t) for t in token_ids]
    assert "".join(pieces) + dec.flush() == tok.decode(token_ids) == text
    assert "" in pieces  # a character split over tokens is held back until whole
    cut = tok.encode("\u2603")  # a character of several byte tokens, cut before its last one
    if len(cut) > 1:
        dec = tok.stream_decoder()
        held = "".join(dec.push(t) for t in cut[:-1])
        assert held + dec.flush() == tok.decode(cut[:-1])
