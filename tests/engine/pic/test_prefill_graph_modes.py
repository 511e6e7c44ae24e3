"""When the prefill-stage graphs are captured (EngineConfig.prefill_graphs, `kvengine serve
--prefill-graphs upfront|idle|lazy`): upfront before the engine is returned, idle by the
engine loop one bucket at a time while no request is in the engine (the server answers
before they exist), lazy on first use; every mode gives the same tokens. On the CPU the
stages run their bucketed static-buffer path eagerly (capture=False), which is what the
CUDA path captures."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from engine.builder import EngineConfig, build_engine, prefill_graph_warmup
from engine.cli import app
from engine.models.config import FULL, GDN, SWA
from engine.models.weights import build_model, save_model
from engine.pic.config import PicConfig
from engine.pic.fused import capture_prefill_stages
from engine.pic.run import attach_planner
from engine.runtime.prefill_graphs import PrefillGraphWarmup, PrefillStages
from engine.runtime.sampling import SamplingParams
from engine.server.worker import EngineLoop
from pic_testlib import pic_config
from test_server import running_server
from typer.testing import CliRunner

BUCKETS = (8, 16, 32)
DOCS = [f"## doc {i}\n" + "".join(f"k{i}{j}: v{j}{i}\n" for j in range(3)) for i in range(3)]
PROMPTS = [[{"text": DOCS[a], "cache": True}, {"text": DOCS[b], "cache": True},
            {"text": f"Q: k{b}1?\nA: ", "cache": False}] for a, b in ((0, 1), (1, 0), (2, 1), (0, 1))]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    save_model(build_model(pic_config([GDN, SWA, FULL], name="prefill-graphs-test"), "cpu", torch.float32, seed=3), d)
    return d


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def staged_engine(model_dir, mode, wrap=None):
    """A CPU engine with PIC and bucketed prefill stages (capture=False), its graphs in `mode`;
    `wrap(engine, capture)` may wrap the per-bucket capture."""
    engine = build_engine(str(model_dir), EngineConfig(device="cpu", dtype="float32", max_num_seqs=4,
                                                       max_num_batched_tokens=256, prefill_chunk_size=16,
                                                       kv_cache_tokens=2048))
    attach_planner(engine, PicConfig(method="pic", seam=4, fused=True, miss_path="alone"))
    engine.runner.prefill_stages = PrefillStages(engine.device, buckets=BUCKETS, capture=False)
    if wrap is None:
        engine.prefill_graphs = prefill_graph_warmup(engine.runner, mode)
    else:
        def capture(b):
            return capture_prefill_stages(engine.runner, buckets=(b,))
        engine.prefill_graphs = PrefillGraphWarmup(engine.runner.prefill_stages, wrap(engine, capture), mode)
    return engine


def through_loop(engine, prompts, before=None):
    """Each prompt through a running EngineLoop, one after the other; their token ids."""
    loop = EngineLoop(engine, idle_wait_s=0.05)
    if before is not None:
        before(loop)
    loop.start()
    try:
        out = []
        for i, p in enumerate(prompts):
            done = threading.Event()
            got = []

            def cb(o, got=got, done=done):
                if o.finished:
                    got.append(o)
                    done.set()
            loop.submit(f"r{i}", PARAMS, cb, prompt=p).result(60)
            assert done.wait(120), "request did not finish"
            out.append(got[0].token_ids)
        return out
    finally:
        loop.stop()


def test_warmup_modes_capture_when_they_say():
    stages = PrefillStages(torch.device("cpu"), buckets=(4, 8), capture=False)
    seen = []
    up = PrefillGraphWarmup(stages, seen.append, "upfront")
    assert seen == [4, 8] and up.ready and up.pending == [] and up.capture_s is not None
    seen.clear()
    idle = PrefillGraphWarmup(stages, seen.append, "idle")
    assert seen == [] and not idle.ready and idle.pending == [4, 8] and idle.capture_s is None
    assert idle.step() and seen == [4] and not idle.ready
    assert idle.step() and seen == [4, 8] and idle.ready and idle.capture_s is not None
    assert not idle.step() and seen == [4, 8]
    lazy = PrefillGraphWarmup(stages, seen.append, "lazy")
    assert not lazy.step() and seen == [4, 8] and not lazy.ready  # requests capture what they use
    assert PrefillGraphWarmup(None, seen.append, "idle").ready  # nothing to capture
    with pytest.raises(ValueError, match="'sometimes' is not one of upfront, idle, lazy"):
        PrefillGraphWarmup(stages, seen.append, "sometimes")


def test_a_failed_idle_capture_leaves_the_rest_to_first_use():
    stages = PrefillStages(torch.device("cpu"), buckets=(4, 8, 16), capture=False)

    def capture(b):
        if b == 8:
            raise RuntimeError("out of memory")
    warm = PrefillGraphWarmup(stages, capture, "idle")
    assert warm.step() and warm.step()
    assert warm.pending == [] and not warm.ready and warm.failed == "bucket 8: out of memory"
    assert not warm.step()
    assert warm.snapshot()["failed"] == "bucket 8: out of memory"
    with pytest.raises(RuntimeError, match="out of memory"):  # up front, the build fails as it did
        PrefillGraphWarmup(stages, capture, "upfront")


def test_every_mode_gives_the_tokens_of_the_plain_engine_and_idle_captures_only_between_requests(model_dir):
    plain = build_engine(str(model_dir), EngineConfig(device="cpu", dtype="float32", max_num_seqs=4,
                                                      max_num_batched_tokens=256, prefill_chunk_size=16,
                                                      kv_cache_tokens=2048))
    attach_planner(plain, PicConfig(method="pic", seam=4, fused=True, miss_path="alone"))
    expected = [plain.generate([p], PARAMS)[0].token_ids for p in PROMPTS]

    for mode in ("upfront", "lazy"):
        engine = staged_engine(model_dir, mode)
        assert all(engine.runner.prefill_stages.has_bucket(b) for b in BUCKETS) == (mode == "upfront")
        assert through_loop(engine, PROMPTS) == expected, mode
        assert any(engine.runner.prefill_stages.has_bucket(b) for b in BUCKETS)  # requests ran the stages

    events = []  # ("capture", bucket, requests in the engine) and ("finished", request)

    def wrap(engine, capture):
        def logged(b):
            events.append(("capture", b, engine.has_unfinished()))
            if len(events) == 1:  # a request arrives while the first bucket is being captured
                loop_box[0].submit("early", PARAMS, lambda o: o.finished and events.append(("finished", "early")),
                                   prompt=PROMPTS[0])
            return capture(b)
        return logged

    loop_box = []
    engine = staged_engine(model_dir, "idle", wrap)
    assert engine.prefill_graphs.pending == list(BUCKETS) and not engine.prefill_graphs.ready
    got = through_loop(engine, PROMPTS, before=loop_box.append)
    deadline = time.monotonic() + 60
    while not engine.prefill_graphs.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == expected
    captures = [e for e in events if e[0] == "capture"]
    assert [e[1] for e in captures] == list(BUCKETS)  # each bucket once, in order
    assert not any(e[2] for e in captures)  # never with a request in the engine
    first_done = events.index(("finished", "early"))
    assert events[0][:2] == ("capture", BUCKETS[0]) and first_done < events.index(captures[1])  # it went first
    assert engine.prefill_graphs.ready and all(engine.runner.prefill_stages.has_bucket(b) for b in BUCKETS)


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def test_the_server_is_ready_before_idle_capture_and_reports_it(model_dir):
    gate = threading.Event()

    def wrap(engine, capture):
        def gated(b):
            assert gate.wait(120)
            return capture(b)
        return gated

    engine = staged_engine(model_dir, "idle", wrap)
    try:
        with running_server(engine) as url:
            models = json.loads(_get(url + "/v1/models"))  # answers while the first capture waits
            assert models["data"][0]["id"] == "prefill-graphs-test"
            health = json.loads(_get(url + "/health"))["prefill_graphs"]
            assert health["mode"] == "idle" and health["ready"] is False and health["capture_s"] is None
            assert "kvengine_prefill_graphs_ready 0.0" in _get(url + "/metrics")
            gate.set()
            deadline = time.monotonic() + 60
            while not json.loads(_get(url + "/health"))["prefill_graphs"]["ready"]:
                assert time.monotonic() < deadline, "idle capture did not finish"
                time.sleep(0.05)
            health = json.loads(_get(url + "/health"))["prefill_graphs"]
            assert health["pending_buckets"] == [] and health["capture_s"] is not None
            assert "kvengine_prefill_graphs_ready 1.0" in _get(url + "/metrics")
    finally:
        gate.set()


def test_serve_refuses_an_unknown_mode_naming_the_option():
    res = CliRunner().invoke(app, ["serve", "--preset", "gla-tiny", "--prefill-graphs", "sometimes"])
    assert res.exit_code == 2
    assert "--prefill-graphs: 'sometimes' is not one of upfront, idle, lazy" in res.output


def test_build_engine_refuses_an_unknown_mode(model_dir):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="not one of upfront, idle, lazy"):
        build_engine(str(model_dir), EngineConfig(device="cpu", prefill_graphs="sometimes"))


def test_not_ready_while_the_last_bucket_is_being_captured():
    stages = PrefillStages(torch.device("cpu"), buckets=(4,), capture=False)
    during = []
    warm = PrefillGraphWarmup(stages, lambda b: during.append((warm.ready, list(warm.pending))), "idle")
    assert warm.step() and warm.ready
    assert during == [(False, [4])]


def test_fla_import_in_background_leaves_the_answer_cached_for_the_runner():
    from engine.models.layers import fla_backend

    fla_backend.fla_importable.cache_clear()
    thread = fla_backend.import_in_background()
    thread.join(120)
    assert not thread.is_alive() and thread.daemon
    assert fla_backend.fla_importable.cache_info().currsize == 1  # resolve_backend does not import again
    hits = fla_backend.fla_importable.cache_info().hits
    fla_backend.fla_importable()
    assert fla_backend.fla_importable.cache_info().hits == hits + 1


def test_idle_turns_capture_the_decode_buckets_after_the_prefill_stages_and_health_shows_them(model_dir):
    """The engine loop's idle turns: every prefill-stage bucket first, then the decode graph
    buckets (DecodeGraphWarmup) one per turn; /health reports both."""
    from engine.runtime.prefill_graphs import DecodeGraphWarmup

    order = []

    def wrap(engine, capture):
        def logged(b):
            order.append(("prefill", b))
            return capture(b)
        return logged

    engine = staged_engine(model_dir, "idle", wrap)
    stages = engine.runner.prefill_stages
    engine.runner.set_cuda_graphs(True)  # the decode step's static-buffer path, eager on the CPU
    engine.runner.prefill_stages = stages
    engine.decode_graphs = DecodeGraphWarmup(engine.runner, 4, "idle")
    decode_capture = engine.runner.capture_decode_graphs

    def logged_decode(max_batch, only=None):
        order.append(("decode", max_batch))
        return decode_capture(max_batch, only)

    engine.runner.capture_decode_graphs = logged_decode
    assert engine.idle_graphs_pending and engine.decode_graphs.pending == [1, 2, 4]
    with running_server(engine) as url:
        deadline = time.monotonic() + 60
        while engine.idle_graphs_pending:
            assert time.monotonic() < deadline, "idle capture did not finish"
            time.sleep(0.05)
        health = json.loads(_get(url + "/health"))
        assert health["prefill_graphs"]["ready"] and health["decode_graphs"]["pending_buckets"] == []
        assert health["decode_graphs"]["captured_buckets"] == [1, 2, 4]
    assert order == [("prefill", b) for b in BUCKETS] + [("decode", b) for b in (1, 2, 4)]
