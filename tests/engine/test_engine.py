"""LLMEngine end to end on tiny presets (real model, real caches, CPU fp32): greedy output
equals a plain step-by-step loop through the runner, batching and chunking and
preemption change no token, the prefill-planner hook runs apply steps in order, and
every request leaves its timeline and no cache behind."""
import pytest
import torch

from engine.builder import EngineConfig, build_engine
from engine.cache.manager import CacheConfig, CacheManager
from engine.errors import CapacityError, InvalidRequestError, RequestNotFoundError
from engine.runtime.planner import ApplyStep, ComputeStep, FullRecomputePlanner, PrefillPlan
from engine.runtime.runner import ModelRunner
from engine.runtime.sampling import SamplingParams
from engine.runtime.sequence import Sequence

GREEDY = SamplingParams(max_new_tokens=12)
PROMPTS = ["The quick brown fox", "a", "Position-independent caching splices segments in.", "0123456789" * 4]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls are fastest on one thread, and the test machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(preset="qwen3next-tiny", planner=None, **kw):
    cfg = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=32,
               kv_cache_tokens=2048)
    cfg.update(kw)
    return build_engine(preset, EngineConfig(**cfg), planner=planner)


def reference_greedy(engine, prompt, n):
    """Prefill the whole prompt, then decode one token at a time, on fresh caches."""
    model = engine.runner.model
    mgr = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=64, num_slots=1))
    runner = ModelRunner(model, mgr, backend="torch")
    seq = mgr.allocate(Sequence("ref"))
    ids = engine.tokenizer.encode(prompt, add_bos=True)
    logits = runner.prefill(seq, ids, 0)
    out = []
    for _ in range(n):
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits = runner.decode([seq], [tok])[0]
    return out


@pytest.mark.parametrize("preset", ["qwen3next-tiny", "gemma3-tiny", "nemotronh-tiny"])
def test_greedy_generate_equals_a_plain_runner_loop(preset):
    engine = make_engine(preset, prefill_chunk_size=7)  # chunked prefill on the engine side
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    (out,) = engine.generate([PROMPTS[2]], params)
    assert out.token_ids == reference_greedy(engine, PROMPTS[2], 12)
    assert out.finish_reason == "length" and engine.cache_usage() == 0.0


def test_concurrent_mixed_length_requests_match_each_alone():
    engine = make_engine(max_num_batched_tokens=24, prefill_chunk_size=8)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in PROMPTS]
    together = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == alone
    assert [o.text for o in together] == [engine.tokenizer.decode(t) for t in alone]
    assert engine.cache_usage() == 0.0


def test_preemption_under_a_small_cache_changes_no_token():
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    roomy = make_engine().generate(PROMPTS, params)
    tight = make_engine(kv_cache_tokens=96)  # 10 blocks = 160 positions; the four need 275
    outs = tight.generate(PROMPTS, params)
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.cache_usage() == 0.0


def test_timeline_orders_arrival_schedule_first_token_finish():
    engine = make_engine()
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5, ignore_eos=True))
    for out in outs:
        tl = out.timeline
        assert tl.arrival <= tl.scheduled <= tl.first_token <= tl.finished
        assert len(tl.token_times) == 5 == len(out.token_ids)
        assert tl.ttft > 0 and tl.decode_tokens_per_s > 0
        assert out.num_prompt_tokens == len(engine.tokenizer.encode(PROMPTS[outs.index(out)], add_bos=True))


class RecordingPlanner(FullRecomputePlanner):
    def __init__(self):
        self.seen = []

    def plan(self, request):
        self.seen.append([(s.text, s.cache, s.token_start, s.token_end) for s in request.segments])
        return super().plan(request)


def test_segments_reach_the_planner_with_their_token_ranges_and_match_the_joined_prompt():
    planner = RecordingPlanner()
    engine = make_engine(planner=planner)
    segs = [{"text": "System: be brief. ", "cache": True}, {"text": "Doc: ü", "cache": True}, {"text": " Q?", "cache": False}]
    (seg_out,) = engine.generate([segs], GREEDY)
    # BOS at position 0 belongs to no segment; each segment's range covers its own bytes
    assert planner.seen == [[("System: be brief. ", True, 1, 19), ("Doc: ü", True, 19, 26), (" Q?", False, 26, 29)]]
    (plain_out,) = engine.generate(["System: be brief. Doc: ü Q?"], GREEDY)
    assert seg_out.token_ids == plain_out.token_ids  # byte tokens: segmenting changes nothing


class ReplayPlanner(FullRecomputePlanner):
    """Stands in for a cache load: its apply step fills the first `k` positions itself
    (here by running them), so only the rest costs compute budget."""

    def __init__(self, k):
        self.k, self.applied, self.done = k, 0, []

    def plan(self, request):
        tokens = request.prefill_token_ids()
        n, k = len(tokens), min(self.k, len(tokens) - 1)

        def load(runner, req):
            runner.prefill(req.seq, tokens[:k], 0)
            self.applied += 1

        return PrefillPlan((ApplyStep(0, k, load, "replay"), ComputeStep(k, n)), n)

    def on_prefill_done(self, request):
        self.done.append(request.request_id)


def test_planner_apply_steps_fill_caches_and_count_as_reused():
    planner = ReplayPlanner(k=20)
    engine = make_engine(prefill_chunk_size=4)
    engine.set_planner(planner)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    (out,) = engine.generate([PROMPTS[2]], params)
    (ref,) = make_engine().generate([PROMPTS[2]], params)
    assert out.token_ids == ref.token_ids
    assert planner.applied == 1 and planner.done == [out.request_id]
    assert out.num_reused_tokens == 20 and engine.stats.num_prompt_tokens_reused == 20
    assert engine.stats.num_prompt_tokens_computed == out.num_prompt_tokens - 20
    assert set(out.timeline.prefill_split) == {"replay", "compute"}  # the time split follows step labels
    assert all(t > 0 for t in out.timeline.prefill_split.values())
    engine.add_request("busy", GREEDY)
    with pytest.raises(InvalidRequestError, match="planner"):
        engine.set_planner(FullRecomputePlanner())


def test_abort_finishes_the_request_and_frees_its_cache():
    engine = make_engine()
    rid = engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.cache_usage() > 0
    engine.abort(rid)
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort" and out.request_id == rid
    assert engine.cache_usage() == 0.0 and not engine.has_unfinished()
    with pytest.raises(RequestNotFoundError):
        engine.abort(rid)


def test_stop_string_cuts_output_and_seeded_sampling_repeats():
    engine = make_engine()
    (free,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, ignore_eos=True))
    stop = free.text[3:5]
    (cut,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, ignore_eos=True, stop_strings=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    hot = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    first = engine.generate([PROMPTS[0]], hot)[0].token_ids
    with_others = engine.generate([PROMPTS[0], PROMPTS[1]], [hot, SamplingParams(max_new_tokens=16, temperature=1.0, seed=9)])
    assert with_others[0].token_ids == first


def test_bad_requests_are_refused_with_the_field_named():
    engine = make_engine(kv_cache_tokens=64, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request("")
    with pytest.raises(InvalidRequestError, match=r"segments\[1\].cache"):
        engine.add_request([{"text": "a"}, {"text": "b", "cache": "yes"}])
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        engine.add_request(prompt_token_ids=[1, 99999])
    with pytest.raises(CapacityError, match="at most 128"):  # (64 tokens + 4 spare slots) rounded to blocks
        engine.add_request("x" * 100, SamplingParams(max_new_tokens=100))
    with pytest.raises(InvalidRequestError, match="max_new_tokens: 250 new tokens after a 11-token prompt exceed"):
        engine.add_request("x" * 10, SamplingParams(max_new_tokens=250))
    with pytest.raises(InvalidRequestError, match="prompt: 301 tokens leave no room"):
        engine.add_request("x" * 300)
    rid = engine.add_request("ok", GREEDY, request_id="mine")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", GREEDY, request_id=rid)
    assert engine.num_waiting == 1


def test_prefill_only_request_finishes_without_tokens():
    engine = make_engine()
    (out,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=0))
    assert out.finished and out.token_ids == [] and out.finish_reason == "length"
    assert engine.stats.num_prompt_tokens_computed == out.num_prompt_tokens


class FailingPlanner(FullRecomputePlanner):
    """An apply step that raises for one request, as a failed cache load would."""

    def plan(self, request):
        if request.request_id != "doomed":
            return super().plan(request)
        n = len(request.prefill_token_ids())

        def load(runner, req):
            raise OSError("segment store unreachable")

        return PrefillPlan((ApplyStep(0, 1, load), ComputeStep(1, n)), n)


def test_a_failing_prefill_fails_only_its_request():
    engine = make_engine(planner=FailingPlanner())
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="doomed")
    engine.add_request(PROMPTS[1], params, request_id="fine")
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["doomed"].finish_reason == "abort" and "segment store unreachable" in finals["doomed"].error
    assert finals["fine"].error is None and len(finals["fine"].token_ids) == 4
    assert engine.cache_usage() == 0.0


def test_generate_refusing_one_prompt_runs_none():
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="segments"):
        engine.generate(["fine", [{"text": 3}]], GREEDY)
    assert not engine.has_unfinished() and engine.cache_usage() == 0.0


def test_host_threads_default_to_one_on_cuda_and_leave_the_cpu_alone():
    from engine.builder import apply_host_threads

    before = torch.get_num_threads()
    try:
        assert apply_host_threads(None, torch.device("cpu")) == before
        assert apply_host_threads(None, torch.device("cuda")) == 1  # no CUDA needed: only the count is set
        assert apply_host_threads(2, torch.device("cpu")) == 2
        with pytest.raises(InvalidRequestError, match="host_threads"):
            apply_host_threads(0, torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
