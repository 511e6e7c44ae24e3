"""One model pass for a whole PIC prefill: every seam, every splice and the suffix of a
request, layer by layer.

The step-by-step plan (engine.pic.planner without `fused`) runs one model pass per
computed range (each seam, each uncached segment, the suffix) with a splice step in
between, so a request with m cached segments pays m+1 passes of per-call host overhead
(on the GPU, tens of milliseconds each for a 2B model: thousands of small kernel
launches) for a few dozen computed tokens. `fused_prefill` gets the same numbers from
ONE pass over the layers:

- the computed positions C (seams, uncached segments, suffix; in prompt order) go
  through embedding, norms, projections, MLPs and attention together;
- full-attention layer: every splice piece's K/V rows for this layer are written into the
  paged pool first (re-rotated through kernels.rope_scatter; where the rows go is worked
  out once per request), then C's own K/V; C's
  queries attend causally over positions [0, end) of the pool (one attention call under
  a mask made once per request for every full layer): a seam token at p sees
  exactly what it saw in the step-by-step plan (everything before p, spliced or
  computed), and nothing after it;
- sliding-window layer: a dense K/V buffer of positions [0, end) holds the rows the
  pieces carry (their last-window rows, re-rotated) and C's rows; queries attend
  causally within the window over the positions present; afterwards the last `window`
  positions present are written to the request's ring (the rows the step-by-step plan
  leaves there);
- linear layer: projections once for C; then, in prompt order, each computed range runs
  its short conv and recurrence from the current (state, conv tail), and each piece
  composes the state (S = T_tail S + E_tail, or S + E_tail for naive addition; E for a
  first placement; in torch: per piece and layer it is one batched matmul, not worth a
  kernel launch of its own) and extends the conv tail: the same sequence of operations as the
  step-by-step plan, without the passes around it. Short ranges (seams) run fla's fused
  recurrent kernel on the GPU, long ones its chunk kernel.

`FusedItem`s tile [seq.num_computed_tokens, end); the last one computes (its last token's
logits are returned). Each layer kind's part of the pass is one function, found by the
cache the kind keeps in `FUSED_LAYERS` (the one dispatch on layer kind); the events the
linear layers walk are engine.pic.fused_events records.
"""
from __future__ import annotations

import functools
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.cache.layer_caches import PagedKVCache, StateSlotCache, WindowRingCache
from engine.cache.manager import CacheManager
from engine.models.decoder import HybridDecoder
from engine.models.layers.attention import one_masked_call, ranges_mask
from engine.models.layers.base import ExternalKVCache
from engine.models.layers.linear_ops import DENSE_FAMILIES
from engine.pic.capture import CaptureSet, LocalIndex, capture_attention, capture_linear
from engine.pic.config import SEAM_CHAIN_MODES
from engine.pic.conv_ranges import conv_ranges
from engine.pic.errors import SplicePlacementError
from engine.pic.fused_events import Computed, Event, Placed
from engine.pic.seam_chain_layer import chain_on, chain_tables, linear_layer_chain
from engine.pic.splice import SplicePiece, attention_part, external_rows, force_triton_for, linear_part
from engine.pic.tokenwise import TokenWise
from engine.runtime.decode_batch import to_device
from engine.runtime.prefill_graphs import PrefillStages
from engine.runtime.sequence import Sequence as CacheSequence
from kernels import rope_delta_cos_sin, rope_scatter

#: computed ranges up to this many tokens run fla's fused recurrent kernel (one launch)
#: rather than its chunk kernel (several launches and host syncs per call)
RECURRENT_MAX_TOKENS = 64


@dataclass(frozen=True)
class FusedItem:
    """Positions [start, end): computed in context (`piece is None`) or spliced from
    `piece` (then start/end are the piece's `start`/`end`)."""

    start: int
    end: int
    piece: Optional[SplicePiece] = None
    #: a computed item that stays its own range (a captured miss's tail, engine.pic.capture):
    #: planners do not merge neighbours into it, so a linear layer runs it as one range
    sealed: bool = False

    @property
    def computes(self) -> bool:
        return self.piece is None


def _check(items: Sequence[FusedItem], pos: int, manager: CacheManager) -> int:
    if not items:
        raise SplicePlacementError("a fused prefill needs at least one item")
    if not items[-1].computes:
        raise SplicePlacementError("the last item of a fused prefill must be computed (its logits are the output)")
    for i, it in enumerate(items):
        if it.start != pos or it.end < it.start:
            raise SplicePlacementError(f"item {i} covers [{it.start}, {it.end}) but the caches will hold {pos}")
        if it.piece is not None:
            it.piece.validate()
            if it.piece.first and pos != 0:
                raise SplicePlacementError("a first placement must start the prompt")
            if (it.piece.start, it.piece.end) != (it.start, it.end):
                raise SplicePlacementError(f"item {i} covers [{it.start}, {it.end}) but its piece "
                                           f"[{it.piece.start}, {it.piece.end})")
            if len(it.piece.signature.layers) != len(manager.layers):
                raise SplicePlacementError(
                    f"signature has {len(it.piece.signature.layers)} layers, the model {len(manager.layers)}")
        pos = it.end
    return pos


@torch.inference_mode()
def fused_prefill(model: HybridDecoder, manager: CacheManager, seq: CacheSequence, token_ids: Sequence[int],
                  items: Sequence[FusedItem], backend: str = "torch", kernel: str = "auto",
                  chain: str = "auto", checkpoints: Sequence = (), all_logits: bool = False,
                  stages: Optional[PrefillStages] = None,
                  captures: Optional[CaptureSet] = None, batch_long_ranges: bool = True,
                  before_layer: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Fill `seq`'s caches over the items (module docstring); returns the last token's
    logits `[vocab]`. `token_ids` are the whole prompt's. `chain`: one of
    SEAM_CHAIN_MODES. `checkpoints`: empty `engine.pic.prefix.BoundaryCheckpoint`s whose
    `end` is the end of a computed item (any boundary inside the fill for one whose
    `with_state` is False: K/V only); each is filled as `capture_checkpoint` would
    fill it at that boundary (prefix caching's snapshots, taken inside the one pass; the
    linear layers then take the per-event path, which sees every boundary's state).
    `all_logits`: return the logits of every position of the last item `[n, vocab]`
    (offline quality measurement reads the question's tokens). `stages`: run the
    token-wise parts (embedding, norms, projections, gates, MLPs) through these
    (engine.runtime.prefill_graphs: CUDA graphs per computed-token bucket); None: plainly.
    `captures`: missing segments computed by this pass whose signatures it takes on the
    way (engine.pic.capture; `captures.signatures()` once it returns).
    `batch_long_ranges`: PicConfig.batch_long_ranges (engine.pic.long_ranges).
    `before_layer(i)`: called before layer i's first read of the pieces' signatures (the
    store planner's per-layer copy waits, engine.connector.layer_loads)."""
    if chain not in SEAM_CHAIN_MODES:
        raise SplicePlacementError(f"chain={chain!r} must be one of {SEAM_CHAIN_MODES}")
    start = seq.num_computed_tokens
    end = _check(items, start, manager)
    manager.ensure_capacity(seq, end)
    device = manager.device
    force = force_triton_for(kernel, device)
    pieces = [it.piece for it in items if it.piece is not None]
    ranges = [(it.start, it.end) for it in items if it.computes and it.end > it.start]
    if captures:
        captures.check(ranges, len(model.blocks))
        captures.prepare(LocalIndex(ranges), manager.device)
    pos_host = torch.cat([torch.arange(a, b) for a, b in ranges])
    ids_host = torch.tensor([token_ids[p] for a, b in ranges for p in range(a, b)], dtype=torch.long)
    model._check_ids(ids_host)
    ids, pos = to_device(ids_host, device), to_device(pos_host, device)  # pinned, no host sync
    ctx_slots = manager.prefill_slots(seq, 0, end, with_context=False)[0]  # expanded on the device
    write_slots = None if ctx_slots is None else ctx_slots[pos]
    # events in prompt order (engine.pic.fused_events)
    events: list[Event] = []
    off = placed = 0
    for it in items:
        if it.piece is not None:
            events.append(Placed(it.piece, placed))
            placed += 1
        elif it.end > it.start:
            n = it.end - it.start
            events.append(Computed(off, off + n, it.end))
            off += n
    ends = {e.end for e in events if isinstance(e, Computed)}
    for cp in checkpoints:
        if not start <= cp.start < cp.end <= end or (cp.with_state and cp.end not in ends):
            raise SplicePlacementError(f"checkpoint [{cp.start}, {cp.end}) does not end a computed item")
    # K/V-only checkpoints (prefix caching's nodes without states) need no split of the
    # linear recurrences and no window rows: only the boundaries that keep states do
    stateful = [cp for cp in checkpoints if cp.with_state]
    tw = TokenWise(model, stages, ids.shape[0], pos)
    p = _Pass(model, manager, seq, pieces, ranges, events, pos, start, end, write_slots, ctx_slots, force, backend,
              chain, device, captures, checkpoints, stateful, batch_long_ranges, tw)
    x, proj = tw.first(ids)
    for i, block in enumerate(model.blocks):
        cache = manager.layers[i]
        if before_layer is not None:
            before_layer(i)
        layer = FUSED_LAYERS.get(type(cache)) or (_external_layer if isinstance(cache, ExternalKVCache) else None)
        if layer is None:  # pragma: no cover - every cache is one of the three
            raise SplicePlacementError(f"layer {i}: cache {type(cache).__name__} cannot be fused")
        o, aux = layer(p, i, cache, block.mixer, proj)
        x, proj = tw.next(i, x, o, aux)
    seq.num_computed_tokens = end
    if all_logits:
        return model.logits(x[x.shape[0] - (items[-1].end - items[-1].start):])
    return model.logits(x[-1])


@dataclass
class _Pass:
    """What every layer of one fused pass shares; `shared` holds per-request layouts that
    every layer of a kind reuses (worked out by the first one)."""

    model: HybridDecoder
    manager: CacheManager
    seq: CacheSequence
    pieces: list
    ranges: list
    events: list
    pos: torch.Tensor
    start: int
    end: int
    write_slots: Optional[torch.Tensor]
    ctx_slots: Optional[torch.Tensor]
    force: bool
    backend: str
    chain: str
    device: torch.device
    captures: Optional[CaptureSet]
    checkpoints: Sequence
    stateful: list
    batch_long_ranges: bool
    tw: TokenWise
    shared: dict = field(default_factory=dict)


def _full_layer(p: _Pass, i: int, cache: PagedKVCache, mixer, proj):
    """A full-attention layer: pieces' rows into the pool, then C attends over [0, end)."""
    o = _full_attend(p.shared, cache, mixer, i, p.pieces, proj, p.ranges, p.write_slots, p.ctx_slots, p.force,
                     _ranges_mask(p, proj[0].dtype))
    if p.captures:
        capture_attention(p.captures, mixer, proj[1], proj[2])
    for cp in p.checkpoints:
        k, v = cache.gather(p.ctx_slots[cp.start:cp.end])
        cp.kv[i] = (k.clone(), v.clone())
    return o, proj[3]


def _external_layer(p: _Pass, i: int, cache: ExternalKVCache, mixer, proj):
    """A full-attention layer kept outside the paged pool (HiSparse, engine/hisparse/): the
    pieces' rows (re-rotated) and C's K/V go into a dense buffer of positions [start, end),
    C attends over the cache's earlier positions and the buffer, and the buffer is appended
    to the cache (which seals full blocks into its host mirror and store as it goes)."""
    if p.checkpoints:
        raise SplicePlacementError("checkpoints (prefix caching) read the paged pool; this layer's K/V is external")
    q, k, v, _ = proj
    n = p.end - p.start
    kb, vb = external_rows(p.pieces, i, mixer, p.start, n, k.dtype, k.device, p.force)
    if kb is None:
        kb, vb = k.new_zeros(n, *k.shape[1:]), v.new_zeros(n, *v.shape[1:])
    local = p.pos - p.start
    kb[local] = k.to(kb.dtype)
    vb[local] = v.to(vb.dtype)
    if p.start:
        past_k, past_v = cache.context_kv(p.seq.slot)
        k_ctx, v_ctx = torch.cat([past_k.to(kb.dtype), kb]), torch.cat([past_v.to(vb.dtype), vb])
    else:
        k_ctx, v_ctx = kb, vb
    o = mixer.attend_ranges(q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), p.ranges, _ranges_mask(p, q.dtype))
    cache.append(p.seq.slot, kb, vb)
    if p.captures:
        capture_attention(p.captures, mixer, proj[1], proj[2])
    return o, proj[3]


def _window_layer(p: _Pass, i: int, cache: WindowRingCache, mixer, proj):
    """A sliding-window layer: a dense buffer of the rows present, then the ring."""
    o = _window_attend(p.shared, p.seq, cache, mixer, i, p.pieces, proj, p.pos, p.ranges, p.start, p.end, p.stateful)
    if p.captures:
        capture_attention(p.captures, mixer, proj[1], proj[2])
    return o, proj[3]


def _linear_pass(p: _Pass, i: int, cache: StateSlotCache, mixer, proj):
    """A linear layer: ranges and compositions in prompt order, through the seam chain
    when it is on (and no checkpoint needs the state between events)."""
    conv_in, aux = proj
    prepare = p.tw.prepare_of(i, aux)
    tap = None
    if p.captures:
        tap = functools.partial(capture_linear, p.captures, mixer, conv_in=conv_in, backend=p.backend)
    if not p.stateful and chain_on(p.chain, mixer, p.device):
        if "chain" not in p.shared:
            p.shared["chain"] = chain_tables(p.model, p.manager, p.events, p.device)
        inp = prepare(conv_ranges(p.seq, cache, mixer, i, p.events, conv_in, shared=p.shared))
        ops: dict = {}
        o = linear_layer_chain(p.seq, cache, mixer, i, p.events, inp, p.shared["chain"][i], p.force, p.backend,
                               ops_out=ops if tap is not None else None, batch_long_ranges=p.batch_long_ranges)
        if tap is not None:  # after the chain: its long ranges run from zero may be the tails
            tap(inp, ops=ops)
        return o, aux
    if "live" not in p.shared:
        p.shared["live"] = _live_index(p.pieces, p.model, p.device)
    o = _linear_layer(p.seq, cache, mixer, i, p.events, conv_in, prepare, p.backend, p.shared["live"], p.stateful,
                      p.shared, tap)
    return o, aux


#: each layer kind's part of the fused pass, by the cache the kind keeps: the one place the
#: fused pass dispatches on layer kind (a new family adds its entry here)
FUSED_LAYERS = {PagedKVCache: _full_layer, WindowRingCache: _window_layer, StateSlotCache: _linear_pass}


@torch.inference_mode()
def capture_prefill_stages(runner, buckets: Optional[Sequence[int]] = None) -> int:
    """Capture the runner's prefill stages (`runner.prefill_stages`) for every bucket up
    front, with one fused pass of b placeholder tokens per bucket on a scratch sequence,
    so that no request pays for a capture. Returns the number of graphs held (0 without
    stages)."""
    stages = getattr(runner, "prefill_stages", None)
    if stages is None:
        return 0
    limit = min(runner.model.config.max_position_embeddings, runner.cache.config.num_blocks * runner.cache.block_size
                if runner.cache.has_paged else runner.model.config.max_position_embeddings)
    for b in (stages.buckets if buckets is None else buckets):
        if b > limit:  # a cache this small never holds such a pass; it would be captured on first use
            continue
        seq = runner.cache.allocate(CacheSequence("prefill-stages-capture"))
        try:
            fused_prefill(runner.model, runner.cache, seq, [0] * b, [FusedItem(0, b)], backend=runner.backend,
                          stages=stages)
        finally:
            runner.cache.free(seq)
    return stages.captured


# ----------------------------------------------------------------------- attention layers
@dataclass
class _FullRows:
    """Where the pieces' full-attention rows go: the same for every full layer (each
    holds K/V of every alone position), so computed once per request."""

    take: list[int]  # per piece: first row of its part taken
    slots: torch.Tensor  # [rows] flat paged slots
    deltas: torch.Tensor  # [rows] position deltas
    single: Optional[int]  # the delta when every piece has the same one
    #: rope_delta_cos_sin of the offsets, by Attention.rope_key (what the layer's
    #: frequencies are made from), so every full layer of one RoPE shares it
    cos_sin: dict = field(default_factory=dict)


def _full_rows(pieces, layer, ctx_slots, device) -> Optional[_FullRows]:
    take, poss, deltas = [], [], []
    for p in pieces:
        part = attention_part(p, layer, "full")
        lo = max(p.first_row - part.first_pos, 0)
        take.append(lo)
        if lo >= part.num_rows:
            continue
        poss.append(torch.arange(part.first_pos + lo + p.delta, part.first_pos + part.num_rows + p.delta))
        deltas.append(torch.full((part.num_rows - lo,), p.delta, dtype=torch.long))
    if not poss:
        return None
    d = torch.cat(deltas)
    uniq = {p.delta for p, lo in zip(pieces, take) if lo < attention_part(p, layer, "full").num_rows}
    return _FullRows(take, ctx_slots[to_device(torch.cat(poss), ctx_slots.device)], to_device(d, device),
                     next(iter(uniq)) if len(uniq) == 1 else None)


def _splice_full_rows(rows: _FullRows, cache: PagedKVCache, mixer, layer, pieces, force) -> None:
    ks, vs = [], []
    for p, lo in zip(pieces, rows.take):
        part = attention_part(p, layer, "full")
        if lo < part.num_rows:
            ks.append(part.k[lo:])
            vs.append(part.v[lo:])
    k, v = torch.cat(ks), torch.cat(vs)
    rot = 2 * mixer.inv_freq.numel()
    if rot == 0:  # no RoPE: positions do not enter K
        cache.write(rows.slots, k, v)
        return
    offset = rows.single if rows.single is not None else rows.deltas
    key = mixer.rope_key
    if key not in rows.cos_sin:
        rows.cos_sin[key] = rope_delta_cos_sin(offset, mixer.inv_freq.to(cache.k_pages.device))
    rope_scatter(k.to(cache.k_pages.device), v.to(cache.k_pages.device), cache.k_pages, cache.v_pages, rows.slots,
                 offset, rotary_dim=rot, inv_freq=mixer.inv_freq, check_slots=False, force_triton=force,
                 cos_sin=rows.cos_sin[key])


def _ranges_mask(p: _Pass, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The full layers' attention mask of the computed ranges against positions [0, end)
    (engine.models.layers.attention.ranges_mask), made once per request; None where they
    attend without one (one range, or a mask past RANGES_MASK_MAX: a call per range)."""
    if not one_masked_call(p.ranges, p.end):
        return None
    key = ("full_mask", dtype)
    if key not in p.shared:
        p.shared[key] = ranges_mask(p.ranges, p.end, dtype, p.device, q_pos=p.pos)
    return p.shared[key]


def _full_attend(state, cache: PagedKVCache, mixer, layer, pieces, proj, ranges, write_slots, ctx_slots, force,
                 mask: Optional[torch.Tensor] = None):
    """A full-attention layer's pieces and C's K/V into the pool; C's attention output: the
    computed ranges against the pool's positions [0, end) as host-known runs (no position
    read back from the device; two or more ranges: one call under `mask`, their
    `ranges_mask`)."""
    q, k, v, _ = proj
    if pieces:
        if "full_rows" not in state:
            state["full_rows"] = _full_rows(pieces, layer, ctx_slots, q.device)
        if state["full_rows"] is not None:
            _splice_full_rows(state["full_rows"], cache, mixer, layer, pieces, force)
    cache.write(write_slots, k, v)
    k_ctx, v_ctx = cache.gather(ctx_slots)
    return mixer.attend_ranges(q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), ranges, mask)


def _present(state: dict, lo: int, start: int, pieces, layer: int, ranges, device) -> tuple[list[int], torch.Tensor]:
    """Positions >= lo whose sliding-window K/V a fill holds (the ring's [lo, start), each
    piece's rows, the computed ranges), ascending, on the host and on the device: worked
    out once per request for every window layer whose pieces' rows lie alike (`state`:
    the request's shared dict)."""
    spans = [(lo, start)] if start > lo else []
    for p in pieces:
        part = attention_part(p, layer, "swa")
        first = max(p.first_row - part.first_pos, 0)
        if first < part.num_rows:
            spans.append((max(lo, part.first_pos + first + p.delta), part.first_pos + part.num_rows + p.delta))
    spans += list(ranges)
    key = ("swa_present", tuple(sorted(spans)))
    got = state.get(key)
    if got is None:
        out: list[int] = []
        for a, b in key[1]:
            a = max(a, out[-1] + 1) if out else a
            out.extend(range(a, b))
        got = state[key] = (out, torch.as_tensor(out, dtype=torch.long).to(device, non_blocking=True))
    return got


def _window_attend(state: dict, seq, cache: WindowRingCache, mixer, layer, pieces, proj, pos, ranges, start, end,
                   checkpoints=()):
    """A sliding-window layer's attention output for C (module docstring); the ring refilled.
    Which positions are present is known on the host (nothing read back from the device)."""
    w = mixer.window
    q, k, v, _ = proj
    lo = max(0, start - w + 1)
    kbuf = torch.zeros(end - lo, *k.shape[1:], dtype=k.dtype, device=k.device)
    vbuf = torch.zeros_like(kbuf)
    if start > lo:  # rows already in the ring (positions before this fill)
        past = torch.arange(lo, start, device=k.device)
        kp, vp = cache.read(seq.slot, past)
        kbuf[: start - lo], vbuf[: start - lo] = kp.to(k.dtype), vp.to(k.dtype)
    for p in pieces:
        part = attention_part(p, layer, "swa")
        first = max(p.first_row - part.first_pos, 0)
        if first >= part.num_rows:
            continue
        alone = torch.arange(part.first_pos + first, part.first_pos + part.num_rows, device=k.device)
        rows_k = part.k[first:].to(device=k.device, dtype=k.dtype)
        if p.delta and mixer.inv_freq.numel():
            rows_k = mixer.rope_shift(rows_k, p.delta)
        at = alone + p.delta - lo
        keep = at >= 0
        kbuf[at[keep]] = rows_k[keep]
        vbuf[at[keep]] = part.v[first:].to(device=k.device, dtype=k.dtype)[keep]
    kbuf[pos - lo], vbuf[pos - lo] = k, v
    present, k_pos = _present(state, lo, start, pieces, layer, ranges, k.device)
    o = mixer.attend_known(q, kbuf[k_pos - lo], vbuf[k_pos - lo], ranges, present, k_pos)
    ring = k_pos[bisect_left(present, end - w):]
    cache.write(seq.slot, ring, kbuf[ring - lo], vbuf[ring - lo])
    for cp in checkpoints:  # every position before a boundary inside this fill is computed
        first = max(0, cp.end - w)
        cp.ring[layer] = (kbuf[first - lo:cp.end - lo].clone(), vbuf[first - lo:cp.end - lo].clone(), first)
    return o


# -------------------------------------------------------------------------- linear layers
def _recurrence(mixer, inp, state, backend):
    short = backend == "fla" and inp.q.shape[1] <= RECURRENT_MAX_TOKENS
    return mixer.run_recurrence(inp, state, backend, step=short)


def _live_index(pieces, model, device) -> dict[tuple[int, int], torch.Tensor]:
    """Device index tensors of the live heads of every partly-forgotten delta-rule part,
    keyed by (piece index, layer): one host-to-device copy per request."""
    keys, flat, bounds = [], [], []
    for j, p in enumerate(pieces):
        for i, part in enumerate(p.signature.layers):
            heads = getattr(part, "live_heads", None)
            if getattr(part, "family", None) in DENSE_FAMILIES and heads and part.tail_transition is not None \
                    and len(heads) < part.num_heads:
                keys.append((j, i))
                bounds.append((len(flat), len(flat) + len(heads)))
                flat.extend(heads)
    if not keys:
        return {}
    dev = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
    return {k: dev[a:b] for k, (a, b) in zip(keys, bounds)}


def _compose(part, piece: SplicePiece, state: torch.Tensor, live: Optional[torch.Tensor], mixer=None) -> torch.Tensor:
    """S = T_tail S + E_tail (S + E_tail for naive addition), float32, in torch: one or two
    small batched ops, the same arithmetic as kernels.state_compose_reference. A `mixer`
    with RoPE inside its recurrence (`uses_positions`) takes E_tail rotated by the
    piece's delta (engine.pic.splice)."""
    E = part.tail_state.to(device=state.device, dtype=torch.float32)
    if getattr(mixer, "uses_positions", False):
        E = mixer.rotate_state(E, piece.delta)
    if piece.linear == "add":
        return state + E
    if part.family in DENSE_FAMILIES:
        if part.tail_transition is None or not part.live_heads:
            return E.clone()  # every head forgot what came before
        T = part.tail_transition.to(device=state.device, dtype=torch.float32)
        if live is None:  # every head live
            return torch.baddbmm(E, T, state)
        return E.index_add(0, live, torch.bmm(T, state.index_select(0, live)))
    decay = torch.exp(part.tail_transition.to(device=state.device, dtype=torch.float32))
    return (decay[:, None, None] if decay.dim() == 1 else decay[..., None]) * state + E


def _linear_layer(seq, cache: StateSlotCache, mixer, layer, events, conv_in, prepare, backend, live, checkpoints=(),
                  shared: Optional[dict] = None, tap=None):
    """A linear layer's events one by one: C's output `[1, C, Hv, dv]`; the slot's state
    and conv tail left as the step-by-step plan leaves them. `conv_in`: C's pre-conv
    inputs `[1, C, ch]`; `prepare(conv_out)`: the layer's RecurrenceInputs; `tap(inp)`
    (optional) sees them before the recurrences run."""
    state = cache.state[seq.slot]
    tails_at: Optional[dict[int, Optional[torch.Tensor]]] = {} if checkpoints else None  # the tails they keep
    inp = prepare(conv_ranges(seq, cache, mixer, layer, events, conv_in, tails_at, shared))
    if tap is not None:
        tap(inp)
    outs: list[torch.Tensor] = []
    for ev in events:
        if isinstance(ev, Placed):
            piece = ev.piece
            part = linear_part(piece, layer)
            if piece.first:
                state = part.state.to(device=state.device, dtype=torch.float32)
            else:
                state = _compose(part, piece, state, live.get((ev.index, layer)), mixer)
            continue
        o, st = _recurrence(mixer, inp.slice_time(ev.lo, ev.hi), state[None], backend)
        state = st[0]
        outs.append(o)
        for cp in checkpoints:
            if cp.end == ev.end:
                t = tails_at.get(ev.end)
                cp.states[layer] = (state.clone(), None if t is None else t.clone())
    cache.state[seq.slot] = state
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
