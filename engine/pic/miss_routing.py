"""Where a request's missing segments go at the PIC planner's miss step
(engine.pic.planner): the cold fallback (`PicConfig.cold_full_fraction`: the whole
prompt computed in context, misses queued for idle time), misses computed in context
(`PicConfig.miss_path="context"`), and the slow hits: hits the store chose not to load
because loading them was expected to take longer than computing them
(`SegmentStore.slow_hits`; the estimate the planner gives it is `hit_compute_ms`), which
count toward the cold fallback's share and are otherwise computed in context, nothing
queued or captured (the store holds them). Functions of the planner's per-request state, called
from the engine loop's thread; `deferred` is the planner's DeferredQueue and `job` makes
a SegmentJob of (prompt token ids, SpliceUnit)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from engine.pic.config import PicConfig
from engine.pic.deferred import DeferredQueue
from engine.pic.layout import SpliceUnit, first_placements
from engine.pic.segment_store import SegmentJob

JobOf = Callable[[Sequence[int], SpliceUnit], SegmentJob]


def fall_back_to_full(config: PicConfig, threshold: Optional[float], state: Any, deferred: DeferredQueue,
                      job: JobOf) -> bool:
    """True when this request's misses hold at least `threshold` of its prompt; they are
    then queued for idle time (or captured, with context signatures), and the request's
    fused step computes the whole prompt."""
    f = threshold
    if f is None or not (state.missing or state.slow) or not config.fused:
        return False
    if sum(u.num_tokens for u in state.missing + state.slow) < f * len(state.token_ids):
        return False
    state.builder.report.slow_hit_segments += len({u.key for u in state.slow})
    state.slow = []  # the full pass computes them; the store keeps them
    if config.miss_signatures == "context":
        state.to_capture = first_placements(state.missing)
        state.builder.report.set_cold_full(0, len(state.to_capture))
    else:
        state.builder.report.set_cold_full(deferred.add([job(state.token_ids, u) for u in state.missing]))
    if state.prefix is not None:  # the restored exact prefix stays reused; the rest is computed
        r = state.builder.report
        r.reused_tokens, r.hit_segments = state.prefix.end, len(state.prefix.path)
        r.suffix_tokens = r.recomputed_tokens = r.prompt_tokens - state.prefix.end
    state.missing = []
    state.full = True
    return True


def misses_in_context(config: PicConfig, state: Any, deferred: DeferredQueue, job: JobOf) -> bool:
    """The fused step computes this request's misses in context (each where its splice
    would be: tail, or anchor + segment when placed first); with alone signatures they are
    queued for idle time. True when there were misses to take."""
    if config.miss_path != "context" or not state.missing or not config.fused:
        return False
    capture = config.miss_signatures == "context"
    if not capture:
        deferred.add([job(state.token_ids, u) for u in state.missing])
    state.in_context.update(u.key for u in state.missing)
    if capture:
        state.to_capture = first_placements(state.missing)
    for key in dict.fromkeys(u.key for u in state.missing):  # every placement of each miss
        state.builder.report.add_in_context_miss(
            sum(u.end - u.splice_start for u in state.units if u.key == key), captured=capture)
    state.missing = []
    return True


def hit_compute_ms(config: PicConfig, ms_per_token: Optional[float], units: Sequence[SpliceUnit],
                   reused: Callable[[SpliceUnit], int]) -> Optional[dict[bytes, float]]:
    """Per distinct key of `units`, the milliseconds computing the positions its hits
    reuse (`reused(u)` per placement) would take in context at `ms_per_token` (the
    planner's measured full-pass cost): what a hit saves, for the store's cost admission
    (SegmentStore.admit). None without a fused step (a slow hit would have nowhere to be
    computed) or before a full pass was measured: every hit is loaded."""
    if not config.fused or ms_per_token is None or not units:
        return None
    out: dict[bytes, float] = {}
    for u in units:
        out[u.key] = out.get(u.key, 0.0) + reused(u) * ms_per_token
    return out


def slow_hits_in_context(state: Any) -> None:
    """The fused step computes the request's slow hits (`state.slow`) in context, each
    where its splice would be; nothing is queued or captured (the store holds them)."""
    for key in dict.fromkeys(u.key for u in state.slow):
        state.in_context.add(key)
        state.builder.report.add_slow_hit(sum(u.end - u.splice_start for u in state.units if u.key == key))
    state.slow = []
