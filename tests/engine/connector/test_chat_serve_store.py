"""/v1/chat/completions as OpenAI chat clients use it: the `openai` Python client against
a REAL `kvengine serve --preset qwen3next-tiny --store` PROCESS and a REAL kvstore daemon.
The answer is the engine's greedy text for the conversation rendered through the presets'
fallback template; streamed deltas join to the same text; a cacheable content part seen
again is reused (`usage.prompt_tokens_details.cached_tokens`); another model's name is a
404 `model_not_found`; a wrong method is a 405 in OpenAI's error shape; /v1/models names
the `--served-model-name`."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from connector_testlib import DOCS, new_engine
from engine.runtime.sampling import SamplingParams
from kvstore.testing import DaemonProcess

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVSTORE_CONFIG": os.devnull}
NAME = "tiny-chat"
CONTEXT = 160  # --max-model-len: small, so a default max_tokens ends soon


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, openai client) of `kvengine serve` with a real daemon behind it."""
    daemon = DaemonProcess(tmp_path_factory.mktemp("chatd"), entry="kvstore.server").start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--preset", "qwen3next-tiny", "--port", "0", "--device", "cpu",
         "--dtype", "float32", "--max-batch", "2", "--kv-cache-tokens", "2048", "--store", str(daemon.socket),
         "--served-model-name", NAME, "--max-model-len", str(CONTEXT)],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        if not m:
            proc.kill()
            raise AssertionError((line, proc.stderr.read()))
        url = m.group(1)
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            daemon.cleanup()


def greedy(segments: list[dict], n: int) -> str:
    """The engine's own greedy text for `segments`, computed in full in this process."""
    engine = new_engine(max_num_seqs=1, kv_cache_tokens=2048)
    (out,) = engine.generate([segments], SamplingParams(max_new_tokens=n, temperature=0.0))
    return out.text


def conversation(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": [{"type": "text", "text": doc, "cache": True},
                                         {"type": "text", "text": question}]}]


def rendered(doc: str, question: str) -> list[dict]:
    """`conversation` as the fallback template renders it, cut at the cacheable part."""
    return [{"text": "system: Answer from the documents.\nuser: ", "cache": False},
            {"text": doc, "cache": True},
            {"text": f"{question}\nassistant: ", "cache": False}]


def test_chat_answer_is_the_greedy_text_of_the_rendered_conversation(served):
    _, client = served
    doc = f"## fresh {uuid.uuid4().hex}\nkey: value\n"
    resp = client.chat.completions.create(model=NAME, messages=conversation(doc, "Q: key?"), max_tokens=6,
                                          temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == NAME
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == greedy(rendered(doc, "Q: key?"), 6)
    want_prompt = 1 + sum(len(s["text"].encode()) for s in rendered(doc, "Q: key?"))  # BOS + bytes
    assert resp.usage.prompt_tokens == want_prompt and resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # never seen before


def test_streamed_deltas_join_to_the_non_streamed_answer(served):
    _, client = served
    messages = [{"role": "user", "content": "Q: value of k1bb?"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_repeated_cacheable_part_is_reused_through_the_store(served):
    _, client = served
    doc = DOCS[1] + f"nonce: {uuid.uuid4().hex}\n"

    def ask(question: str):
        return client.chat.completions.create(model=NAME, messages=conversation(doc, question), max_tokens=2,
                                              temperature=0)

    assert ask("Q: k2aa?").usage.prompt_tokens_details.cached_tokens == 0
    deadline = time.monotonic() + 60  # misses are stored while the engine is idle
    warm = ask("Q: k2cc?")  # the same document in another conversation
    while warm.usage.prompt_tokens_details.cached_tokens == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        warm = ask("Q: k2cc?")
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= len(doc.encode())  # at most the document's own tokens
    assert warm.timings["reused_prompt_tokens"] == cached


def test_models_names_the_served_model_and_another_name_is_404(served):
    _, client = served
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="qwen3next-tiny", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found" and err.value.body["param"] == "model"


def test_bad_chat_requests_get_openai_shaped_errors(served):
    url, client = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert err.value.body["param"] == "messages[0].content[0].type"
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(url + "/v1/chat/completions", timeout=30)  # GET
    assert http.value.code == 405 and http.value.headers["Allow"] == "POST"
    body = json.loads(http.value.read())
    assert body["error"]["code"] == "method_not_allowed" and body["error"]["type"] == "invalid_request_error"


def test_without_max_tokens_the_answer_may_run_to_the_end_of_the_context(served):
    _, client = served
    resp = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Q: k3aa?"}],
                                          temperature=0)
    usage, finish = resp.usage, resp.choices[0].finish_reason
    assert usage.prompt_tokens + usage.completion_tokens <= CONTEXT
    assert finish == "stop" or usage.prompt_tokens + usage.completion_tokens == CONTEXT
    with pytest.raises(openai.BadRequestError) as err:  # asked for more than the context holds
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=CONTEXT)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x" * CONTEXT}])
    assert err.value.body["param"] == "messages"
