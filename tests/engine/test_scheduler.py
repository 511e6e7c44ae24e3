"""Scheduler policy over a real CacheManager: token budget and chunk size per step,
strict FCFS admission, batch limit, preemption when blocks run out, clear refusal of
requests that can never fit, and every cache block and slot returned at the end.

The model is not run here (tests/engine/test_engine.py does that); a small driver plays
the engine's part: it advances each granted prefill chunk and appends a token per
decode, exactly as LLMEngine.step does around the runner calls.
"""
import random

import pytest

from engine.cache.manager import PAGED, STATE, CacheConfig, CacheManager, LayerCacheSpec
from engine.errors import CapacityError, InvalidRequestError, PlanError
from engine.runtime.cache_pool import ManagedCachePool
from engine.runtime.planner import ApplyStep, ComputeStep, PrefillPlan
from engine.runtime.request import FinishReason, PromptSegment, Request, RequestStatus
from engine.runtime.sampling import SamplingParams
from engine.runtime.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def make_pool(num_blocks=64, num_slots=8):
    specs = [
        LayerCacheSpec(PAGED, num_kv_heads=1, head_dim=4),
        LayerCacheSpec(STATE, state_shape=(1, 2, 2), conv_tail_shape=(2, 3)),
    ]
    manager = CacheManager(specs, CacheConfig(block_size=BLOCK, num_blocks=num_blocks, num_slots=num_slots))
    return ManagedCachePool(manager)


def make_request(i, prompt_len, max_tokens):
    ids = [7] * prompt_len
    return Request(
        f"r{i}", ids, [PromptSegment("", False, 0, prompt_len)], SamplingParams(max_new_tokens=max_tokens)
    )


class Driver:
    """Plays LLMEngine.step's part around the scheduler, recording what happened."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.outputs = []
        self.admitted = []

    def step(self):
        out = self.sched.schedule()
        self.outputs.append(out)
        self.admitted += [r.request_id for r in out.admitted]
        for r in out.decodes:
            self._emit(r)
        for chunk in out.prefills:
            r, grant = chunk.request, chunk.num_tokens
            prog = r.progress
            while not prog.done:
                step = prog.current
                if isinstance(step, ApplyStep):
                    step.apply(None, r)
                    prog.skip_apply()
                    continue
                if grant == 0:
                    break
                n = min(grant, step.end - step.start - prog.offset)
                prog.advance(n)
                grant -= n
            if prog.done:
                self.sched.mark_prefilled(r)
                self._emit(r)
        return out

    def _emit(self, r):
        r.output_token_ids.append(1)
        if r.num_output_tokens >= r.sampling.max_new_tokens:
            self.sched.finish(r, FinishReason.LENGTH)

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("scheduler did not finish the workload")


def test_token_budget_and_chunk_size_hold_in_every_step():
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, prefill_chunk_size=10)
    pool = make_pool()
    sched = Scheduler(cfg, pool)
    rng = random.Random(0)
    reqs = [make_request(i, rng.randint(1, 40), rng.randint(1, 6)) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    driver = Driver(sched)
    driver.run()
    assert all(out.num_scheduled_tokens <= 24 for out in driver.outputs)
    assert all(c.num_tokens <= 10 for out in driver.outputs for c in out.prefills)
    assert all(len(out.decodes) + len(out.prefills) <= 6 for out in driver.outputs)
    assert max(out.num_scheduled_tokens for out in driver.outputs) == 24  # the budget is actually used
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == r.sampling.max_new_tokens for r in reqs)


def test_admission_and_prefill_budget_follow_arrival_order():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=8), make_pool())
    reqs = [make_request(i, n, 3) for i, n in enumerate([30, 5, 12, 1, 25, 7, 3])]
    for r in reqs:
        sched.add_request(r)
    driver = Driver(sched)
    driver.run()
    order = [r.request_id for r in reqs]
    assert driver.admitted == order
    for out in driver.outputs:  # prompt budget goes to the oldest admitted requests first
        granted = [c.request.request_id for c in out.prefills]
        assert granted == sorted(granted, key=order.index)


def test_cache_usage_returns_to_zero_after_all_requests_finish():
    pool = make_pool(num_blocks=40, num_slots=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16), pool)
    reqs = [make_request(i, 10 + 3 * i, 5) for i in range(9)]
    for r in reqs:
        sched.add_request(r)
    driver = Driver(sched)
    driver.step()
    assert pool.usage() > 0
    driver.run()
    assert pool.usage() == 0.0
    assert pool.num_used_blocks == 0 and pool.num_used_slots == 0
    assert all(r.seq is None for r in reqs)


def test_out_of_blocks_preempts_newest_and_everything_still_completes():
    # 12 blocks of 4 = 48 positions; three requests of 12 prompt + 12 output need 72.
    pool = make_pool(num_blocks=12, num_slots=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64), pool)
    reqs = [make_request(i, 12, 12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    driver = Driver(sched)
    driver.run()
    preempted = [r.request_id for out in driver.outputs for r in out.preempted]
    assert preempted, "the workload should have run out of blocks"
    assert "r0" not in preempted  # the oldest request is never the victim while others run
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == len(preempted) == sched.num_preemptions
    assert pool.num_used_blocks == 0 and pool.num_used_slots == 0


def test_preempted_request_is_readmitted_before_later_arrivals():
    pool = make_pool(num_blocks=8, num_slots=4)  # 32 positions
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64), pool)
    a, b = make_request(0, 8, 16), make_request(1, 8, 16)
    for r in (a, b):
        sched.add_request(r)
    driver = Driver(sched)
    while not any(out.preempted for out in driver.outputs):
        driver.step()
    late = make_request(2, 4, 2)
    sched.add_request(late)
    assert sched.waiting[0] is b and sched.waiting[-1] is late
    driver.run()
    assert driver.admitted.index("r1", 2) < driver.admitted.index("r2")  # r1's readmission precedes r2


def test_request_larger_than_the_whole_cache_is_refused_with_the_numbers():
    sched = Scheduler(SchedulerConfig(), make_pool(num_blocks=4))  # 16 positions
    with pytest.raises(CapacityError, match=r"needs 20 cache positions \(12 prompt \+ 8 max_new_tokens\).*at most 16"):
        sched.add_request(make_request(0, 12, 8))
    assert not sched.has_unfinished()


def test_batch_limit_caps_requests_holding_caches():
    pool = make_pool(num_slots=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, prefill_chunk_size=100), pool)
    for i in range(5):
        sched.add_request(make_request(i, 4, 4))
    driver = Driver(sched)
    for _ in range(3):
        driver.step()
        assert sched.num_running <= 2 and pool.num_used_slots <= 2
    driver.run()


def test_finishing_waiting_and_running_requests_frees_their_caches():
    pool = make_pool()
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4, prefill_chunk_size=4), pool)
    running, waiting = make_request(0, 10, 4), make_request(1, 10, 4)
    sched.add_request(running)
    sched.add_request(waiting)
    Driver(sched).step()
    assert running.status is RequestStatus.PREFILLING and pool.num_used_slots == 1
    sched.finish(waiting, FinishReason.ABORT)
    sched.finish(running, FinishReason.ABORT)
    assert running.finish_reason is FinishReason.ABORT and waiting.is_finished
    assert pool.usage() == 0.0 and not sched.has_unfinished()


class _SplicePlanner:
    """Fills the first `reuse` positions with an apply step, computes the rest."""

    def __init__(self, reuse):
        self.reuse = reuse
        self.applied, self.freed = [], []

    def plan(self, request):
        n = len(request.prefill_token_ids())
        k = min(self.reuse, n - 1)
        steps = (ApplyStep(0, k, lambda runner, req: self.applied.append(req.request_id)), ComputeStep(k, n))
        return PrefillPlan(steps, n)

    def on_prefill_done(self, request):
        pass

    def on_request_freed(self, request):
        self.freed.append(request.request_id)


def test_planner_reuse_is_free_of_token_budget_and_freed_requests_are_reported():
    planner = _SplicePlanner(reuse=30)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk_size=8), make_pool(), planner)
    req = make_request(0, 34, 2)
    sched.add_request(req)
    driver = Driver(sched)
    out = driver.step()
    assert [c.num_tokens for c in out.prefills] == [4]  # only the 4 computed tokens cost budget
    assert req.status is RequestStatus.DECODING and planner.applied == ["r0"]
    driver.run()
    assert planner.freed == ["r0"]


@pytest.mark.parametrize(
    "steps, n, message",
    [
        ((), 4, "empty plan"),
        ((ComputeStep(1, 4),), 4, "step 0 covers"),
        ((ComputeStep(0, 3),), 4, "ends at position 3"),
        ((ComputeStep(0, 2), ApplyStep(2, 4, lambda r, q: None)), 4, "last step must be a ComputeStep"),
        ((ApplyStep(0, 2, lambda r, q: None), ComputeStep(2, 2), ComputeStep(2, 4)), 4, "computes no tokens"),
    ],
)
def test_malformed_plans_are_rejected(steps, n, message):
    with pytest.raises(PlanError, match=message):
        PrefillPlan(steps, n).validate()


def test_a_bad_plan_fails_only_its_request_and_leaves_no_cache_behind():
    class Broken(_SplicePlanner):
        def plan(self, request):
            if request.request_id == "r0":
                return PrefillPlan((ComputeStep(0, 1),), 1)  # wrong length
            return super().plan(request)

    pool = make_pool()
    sched = Scheduler(SchedulerConfig(), pool, Broken(0))
    bad, good = make_request(0, 5, 1), make_request(1, 5, 1)
    sched.add_request(bad)
    sched.add_request(good)
    out = sched.schedule()
    assert out.refused == [bad] and bad.finish_reason is FinishReason.ABORT
    assert "plan for 1 tokens, request has 5" in bad.error
    assert out.admitted == [good] and pool.num_used_slots == 1


def test_config_rejects_a_budget_below_the_batch_limit_naming_the_field():
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens.*below max_num_seqs=8"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(InvalidRequestError, match="prefill_chunk_size"):
        SchedulerConfig(prefill_chunk_size=0)


def test_admission_keeps_a_watermark_of_blocks_unless_the_pool_is_idle():
    pool = make_pool(num_blocks=100, num_slots=4)  # 1% watermark: 1 block
    assert pool.watermark_blocks == 1
    assert pool.can_allocate(400)  # idle: the whole pool may go to one request
    seq = pool.allocate("a", 4)  # 1 block
    assert not pool.can_allocate(396)  # 99 blocks free, 99 needed: would leave no headroom
    assert pool.can_allocate(392)
    pool.free(seq)
