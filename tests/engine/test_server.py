"""The HTTP API end to end: a real aiohttp server on a free localhost port, serving a
tiny preset through the engine loop thread, driven by a plain HTTP client (urllib).
Completions (plain, streamed, segmented), 400s naming the field, 503 for a request that
can never fit, /health, /metrics, concurrency, and abort on client disconnect."""
import asyncio
import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.builder import EngineConfig, build_engine
from engine.runtime.sampling import SamplingParams
from engine.server.app import start_server

PRESET = "gla-tiny"
CONFIG = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                      prefill_chunk_size=16, kv_cache_tokens=1024)


@contextlib.contextmanager
def running_server(engine):
    """Serve `engine` on a free localhost port from a background event loop thread."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    info = {}

    def run():
        asyncio.set_event_loop(loop)
        runner, port = loop.run_until_complete(start_server(engine, "127.0.0.1", 0))
        info.update(runner=runner, port=port)
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "server did not start"
    try:
        yield f"http://127.0.0.1:{info['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(one_thread):
    with running_server(build_engine(PRESET, CONFIG)) as url:
        yield url


@pytest.fixture(scope="module")
def reference():
    """A second engine with the same weights, for expected outputs."""
    engine = build_engine(PRESET, CONFIG)

    def greedy(prompt, n):
        return engine.generate([prompt], SamplingParams(max_new_tokens=n))[0]

    return greedy


def post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def stream_events(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().rstrip("\n")
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def metric_value(text, name):
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_completion_returns_the_engines_greedy_text_with_usage(server, reference):
    status, body = post(server, {"model": PRESET, "prompt": "Hello, world", "max_tokens": 8, "temperature": 0})
    assert status == 200
    expected = reference("Hello, world", 8)
    assert body["object"] == "text_completion" and body["model"] == PRESET and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == expected.text and choice["finish_reason"] == expected.finish_reason
    assert body["usage"] == {"prompt_tokens": expected.num_prompt_tokens, "completion_tokens": len(expected.token_ids),
                             "total_tokens": expected.num_prompt_tokens + len(expected.token_ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # full recompute: nothing cached
    assert body["timings"]["ttft_ms"] > 0


def test_streamed_chunks_join_to_the_same_text_and_end_with_done(server, reference):
    events = stream_events(server, {"prompt": "Streaming test", "max_tokens": 10, "temperature": 0,
                                    "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    expected = reference("Streaming test", 10)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_segments_field_is_an_alternative_to_prompt(server, reference):
    segs = [{"text": "Doc one. ", "cache": True}, {"text": "Doc two. ", "cache": True}, {"text": "Question?", "cache": False}]
    status, body = post(server, {"segments": segs, "max_tokens": 6, "temperature": 0})
    assert status == 200
    assert body["choices"][0]["text"] == reference("Doc one. Doc two. Question?", 6).text


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"segments": [{"text": "a"}, {"cache": True}]}, "segments[1].text"),
        ({"prompt": "x", "segments": [{"text": "y"}]}, "prompt"),
        ({"prompt": [1, 2, 70000]}, "prompt"),
        ({"prompt": "x", "max_tokens": 9000}, "max_tokens"),
    ],
)
def test_bad_request_gets_400_naming_the_field(server, body, field):
    status, err = post(server, body)
    assert status == 400
    assert err["error"]["param"] == field and field in err["error"]["message"]


def test_malformed_json_gets_400_naming_the_body(server):
    status, err = post(server, None, raw=b"{not json")
    assert status == 400 and err["error"]["param"] == "body"


def test_request_larger_than_the_cache_gets_503(server):
    status, err = post(server, {"prompt": "y" * 600, "max_tokens": 2000})
    assert status == 503 and "cache positions" in err["error"]["message"]


def test_concurrent_requests_each_get_their_own_answer(server, reference):
    prompts = ["alpha", "a much longer prompt that takes several prefill chunks to compute", "gamma", "δέλτα"]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: post(server, {"prompt": p, "max_tokens": 7, "temperature": 0}), prompts))
    assert [s for s, _ in results] == [200] * 4
    assert [b["choices"][0]["text"] for _, b in results] == [reference(p, 7).text for p in prompts]


def test_health_and_metrics_report_the_engine(server):
    with urllib.request.urlopen(server + "/health", timeout=30) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    before = metrics(server)
    post(server, {"prompt": "count me", "max_tokens": 3})
    after = metrics(server)
    for name in ("kvengine_num_requests_running", "kvengine_num_requests_waiting", "kvengine_cache_usage_ratio",
                 "kvengine_generation_tokens_per_second", "kvengine_time_to_first_token_seconds_count"):
        assert metric_value(after, name) is not None, name
    done = 'kvengine_requests_total{finish_reason="length"}'
    assert (metric_value(after, done) or 0) >= (metric_value(before, done) or 0) + 1
    assert metric_value(after, "kvengine_generation_tokens_total") >= 3
    assert metric_value(after, "kvengine_cache_usage_ratio") == 0.0


def test_client_disconnect_mid_stream_aborts_the_request(server):
    before = metric_value(metrics(server), 'kvengine_requests_total{finish_reason="abort"}') or 0
    req = urllib.request.Request(server + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "never ending", "max_tokens": 900, "stream": True,
                                                  "temperature": 0}).encode())
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data: ")
    resp.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        text = metrics(server)
        if (metric_value(text, 'kvengine_requests_total{finish_reason="abort"}') or 0) > before:
            break
        time.sleep(0.1)
    assert (metric_value(text, 'kvengine_requests_total{finish_reason="abort"}') or 0) == before + 1
    assert metric_value(text, "kvengine_num_requests_running") == 0


def test_a_failed_engine_step_gives_500_and_unhealthy(monkeypatch):
    engine = build_engine(PRESET, CONFIG)

    def broken_decode(seqs, last_tokens):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "decode", broken_decode)
    with running_server(engine) as url:
        status, err = post(url, {"prompt": "hi", "max_tokens": 5})
        assert status == 500 and "device lost" in err["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert info.value.code == 503 and "device lost" in json.loads(info.value.read())["error"]
        status, err = post(url, {"prompt": "again", "max_tokens": 5})
        assert status == 503 and err["error"]["type"] == "engine_stopped"


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.headers["Content-Type"], json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], json.loads(err.read())


def test_unknown_routes_and_methods_answer_openai_shaped_json(server):
    status, ctype, body = _get(server + "/v1/nothing-here")
    assert status == 404 and ctype.startswith("application/json")
    assert body["error"]["code"] == "not_found" and "/v1/nothing-here" in body["error"]["message"]
    status, ctype, body = _get(server + "/v1/completions")  # GET on a POST route
    assert status == 405 and ctype.startswith("application/json")
    assert body["error"]["code"] == "method_not_allowed" and "POST" in body["error"]["message"]


def test_a_request_for_another_model_is_404_model_not_found(server):
    status, body = post(server, {"prompt": "hi", "max_tokens": 1, "model": "gpt-4"})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    status, body = post(server, {"prompt": "hi", "max_tokens": 1, "model": PRESET})  # the served one is fine
    assert status == 200


def test_unsupported_sampling_fields_are_refused_not_ignored(server):
    for field, value in (("presence_penalty", 1.0), ("logit_bias", {"1": 5}), ("echo", True), ("n", 2)):
        status, body = post(server, {"prompt": "hi", "max_tokens": 1, field: value})
        assert status == 400 and body["error"]["param"] == field, (field, body)


def test_models_says_when_the_server_started(server):
    status, _, body = _get(server + "/v1/models")
    created = body["data"][0]["created"]
    assert status == 200 and abs(created - time.time()) < 3600 and body["data"][0]["id"] == PRESET


def test_streamed_usage_chunk_has_cached_tokens(server):
    events = stream_events(server, {"prompt": "hello", "max_tokens": 2, "temperature": 0,
                                    "stream_options": {"include_usage": True}})
    usage = [json.loads(e) for e in events if e != "[DONE]" and json.loads(e).get("usage")][-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0} and usage["completion_tokens"] == 2
