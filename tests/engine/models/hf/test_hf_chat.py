"""/v1/chat/completions on a Hugging Face checkpoint (tiny random Qwen3.5 whose tokenizer
puts <bos> in front, with a ChatML template): the `openai` client against a REAL
`kvengine serve --model DIR --store` process and a REAL kvstore daemon. The answer is
transformers' own greedy continuation of the conversation rendered by the checkpoint's
template and cut at the cacheable part (each piece tokenized alone); streamed deltas join
to it; the part is reused when it recurs; /v1/models names the directory. A template
that drops a cacheable part, and a checkpoint without a template, are 400s. On the other
architectures (Qwen3-Next, Qwen3.5-MoE, Gemma 3, Nemotron-H) the chat answer is
transformers' greedy text too."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

import hf_testlib as H  # noqa: E402
from engine.errors import InvalidRequestError  # noqa: E402
from engine.models.hf.tokenizer import CheckpointTokenizer  # noqa: E402
from engine.server.chat import parse_chat_request, render_segments  # noqa: E402
from kvstore.testing import DaemonProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KVSTORE_CONFIG": os.devnull}
DOC = "Retrieved documents, tool outputs and a system prompt recur across requests. hello cache 0 1 2"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "tiny-qwen3_5-chat"
    model, ids = H.build("qwen3_5", d, with_bos=True, seed=5)
    return model, d, ids


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    _, d, _ = checkpoint
    daemon = DaemonProcess(tmp_path_factory.mktemp("chatd"), entry="kvstore.server").start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(d), "--port", "0", "--device", "cpu",
         "--max-batch", "2", "--kv-cache-tokens", "512", "--store", str(daemon.socket)],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        if not m:
            proc.kill()
            raise AssertionError((line, proc.stderr.read()))
        yield openai.OpenAI(base_url=m.group(1) + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            daemon.cleanup()


def messages(question: str, doc: str = DOC) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": doc, "cache": True},
                                         {"type": "text", "text": question}]}]


def reference_text(checkpoint, question: str, n: int, doc: str = DOC) -> tuple[str, int]:
    """transformers' greedy text for the template's rendering (written out here) of
    `messages(question, doc)`, each piece tokenized alone (behind <bos> when the tokenizer
    puts one in front); and the prompt length."""
    model, d, ids = checkpoint
    tok = CheckpointTokenizer(d)
    pieces = ["<|im_start|>user\n", doc, f"{question}<|im_end|>\n<|im_start|>assistant\n"]
    prompt = ([] if tok.bos_id is None else [tok.bos_id]) + [t for p in pieces for t in tok.encode(p)]
    _, _, gen = H.reference_greedy(model, prompt, n - 1)
    stop = next((i for i, t in enumerate(gen) if t in tok.stop_ids), None)
    return tok.decode(gen if stop is None else gen[:stop + 1]), len(prompt)


def test_chat_answers_with_the_checkpoints_greedy_text(served, checkpoint):
    name = checkpoint[1].name
    want, prompt_tokens = reference_text(checkpoint, " Q: what recurs?", 4)
    resp = served.chat.completions.create(model=name, messages=messages(" Q: what recurs?"), max_tokens=4,
                                          temperature=0)
    assert resp.choices[0].message.content == want
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # a first sight is computed in full


def test_streamed_deltas_join_to_the_checkpoints_greedy_text(served, checkpoint):
    doc = "numbers 3 4 5, " + DOC  # another part: computed in full, as the reference is
    want, _ = reference_text(checkpoint, " Q?", 4, doc)
    chunks = list(served.chat.completions.create(model=checkpoint[1].name, messages=messages(" Q?", doc),
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_models_names_the_checkpoint_directory(served, checkpoint):
    assert [m.id for m in served.models.list().data] == ["tiny-qwen3_5-chat"]
    with pytest.raises(openai.NotFoundError) as err:
        served.chat.completions.create(model="gpt-4o", messages=messages(" Q?"))
    assert err.value.code == "model_not_found"


def test_the_cacheable_part_is_reused_in_another_conversation(served, checkpoint):
    name = checkpoint[1].name
    doc = "hello daemon 7 8 9, " + DOC  # seen by no other test
    first = served.chat.completions.create(model=name, messages=messages(" Q: first?", doc), max_tokens=1)
    deadline = time.monotonic() + 60  # misses are stored while the engine is idle
    while True:
        warm = served.chat.completions.create(model=name, messages=messages(" Q: second?", doc), max_tokens=1)
        cached = warm.usage.prompt_tokens_details.cached_tokens
        if cached or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    doc_tokens = len(CheckpointTokenizer(checkpoint[1]).encode(doc))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < cached <= doc_tokens  # the part's tokens, less the seam recomputed in context


def _with_template(src: Path, dst: Path, template) -> CheckpointTokenizer:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return CheckpointTokenizer(dst)


def test_a_template_that_drops_a_cacheable_part_is_refused_naming_it(checkpoint, tmp_path):
    last_only = "{{ messages[-1]['content'] }}"  # drops every earlier message
    tok = _with_template(checkpoint[1], tmp_path, last_only)
    req = parse_chat_request({"messages": [{"role": "system", "content": "sys", "cache": True},
                                           {"role": "user", "content": "hi"}]})
    with pytest.raises(InvalidRequestError) as err:
        render_segments(tok, req.messages)
    assert err.value.field == "messages[0].content" and "dropped" in err.value.message


def test_a_checkpoint_without_a_chat_template_is_refused(checkpoint, tmp_path):
    tok = _with_template(checkpoint[1], tmp_path, None)
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(InvalidRequestError, match="no chat template"):
        render_segments(tok, req.messages)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "gemma3", "nemotron_h", "bailing_moe_linear",
                                  "kimi_linear", "bailing_hybrid"])
def test_chat_answers_the_openai_client_on_every_architecture(arch, tmp_path):
    """`kvengine serve --model` (no store) on each architecture's tiny checkpoint: the chat
    answer is transformers' greedy continuation of the template's rendering (qwen3_5 is
    covered above, with a store)."""
    model, ids = H.build(arch, tmp_path / arch, seed=7)
    want, prompt_tokens = reference_text((model, tmp_path / arch, ids), " Q: what recurs?", 3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(tmp_path / arch), "--port", "0", "--device",
         "cpu", "--max-batch", "1", "--kv-cache-tokens", "512"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        client = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="unused", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model=arch, messages=messages(" Q: what recurs?"), max_tokens=3,
                                              temperature=0)
        assert resp.choices[0].message.content == want
        assert resp.usage.prompt_tokens == prompt_tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_template_kwargs_reach_the_template_and_plain_rendering_is_chat_prompts(checkpoint, tmp_path):
    thinking = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    tok = _with_template(checkpoint[1], tmp_path, thinking)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": DOC, "cache": True},
                                                      {"type": "text", "text": " Q?"}]}]}
    plain = render_segments(tok, parse_chat_request(body).messages)
    assert plain == [{"text": "user: ", "cache": False}, {"text": DOC, "cache": True},
                     {"text": " Q?\n", "cache": False}]  # <bos> dropped from the front: the engine adds it
    off = parse_chat_request({**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert render_segments(tok, off.messages, off.template_kwargs)[-1]["text"] == " Q?\n<think></think>"
    whole = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert [s["text"] for s in render_segments(tok, whole.messages)] == [
        tok.chat_prompt([{"role": "user", "content": "hi"}])]
