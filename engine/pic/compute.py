"""Computing a segment alone and extracting its signature (engine.pic.signature).

`compute_signature(model, token_ids, anchor_ids, split)` runs the anchor plus the segment
through the model from position 0 and zero state, exactly as `HybridDecoder.prefill`
runs one chunk at position 0 on empty caches (same modules, same order, same dtypes), so
the K/V, states and conv tails it returns are bit-identical to what a plain prefill of
that chunk writes into the caches. It needs no cache slot or KV blocks: the pass keeps
its own tensors, which become the signature. Per linear layer it also runs the recurrence
over the tail tokens from zero (E_tail) and derives their transition operator T_tail
(log-decay sums; for the delta rule the same recurrence from S0 = I with v = 0, as HYPIC
does, through fla on the GPU when the runner uses it).

The last block's MLP is skipped: nothing a signature holds depends on it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from engine.models.decoder import HybridDecoder
from engine.models.layers.attention import Attention
from engine.models.layers.linear_base import LinearMixer
from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import DENSE_FAMILIES, RecurrenceInputs, end_state_from_zero, head_log_sums
from engine.pic import long_ranges
from engine.pic.errors import AlonePassStopped, SignatureFormatError
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature

#: log of the smallest normal float32: a head whose tail decay product is below it has
#: forgotten its prefix (||T|| <= exp(sum of log decays) for the gated delta rule).
LOG_FLOAT32_TINY = math.log(torch.finfo(torch.float32).tiny)

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_state_dtype(name: str, model_dtype: Optional[torch.dtype]) -> torch.dtype:
    """PicConfig.state_dtype -> the dtype alone passes keep linear states in: "auto" is
    the model's dtype when that is bfloat16 or float16, else float32."""
    if name == "auto":
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float32
    return STATE_DTYPES[name]


def _check_segment(n: int, split: int, keep_end_state: bool) -> None:
    if n < 1:
        raise SignatureFormatError("a segment needs at least one token")
    if split < 0:
        raise SignatureFormatError(f"split={split} must be >= 0")
    if not keep_end_state and split >= n:
        raise SignatureFormatError(f"without end states a signature needs a tail, but split={split} >= n={n}")


def compute_signature(model: HybridDecoder, token_ids: Sequence[int], anchor_ids: Sequence[int] = (),
                      split: int = 0, backend: str = "torch", state_dtype: torch.dtype = torch.float32,
                      keep_end_state: bool = True,
                      should_stop: Optional[Callable[[], bool]] = None) -> SegmentSignature:
    """The signature of `token_ids` computed alone behind `anchor_ids` (module docstring).
    `split`: seam length; tokens [split, n) form the reusable tail. `backend`: the
    linear-layer backend of the runner ("torch" or "fla"). `keep_end_state`: keep each
    linear layer's end state E (needed only to place the segment first). `should_stop`:
    asked between layers; True raises AlonePassStopped (idle work giving way)."""
    return _run_to_end(AlonePass(model, [(token_ids, split)], anchor_ids, backend, state_dtype, keep_end_state),
                       should_stop)[0]


def _attention_alone(mixer: Attention, h: torch.Tensor, positions: torch.Tensor):
    q, k, v, gate = mixer.project(h, positions)
    o = mixer.attend_prefill(q, k, v, positions, positions)
    out = mixer.output(o, gate)
    if mixer.window is None:
        return out, AttentionPart("full", k, v, 0)
    total = k.shape[0]
    m = min(total, mixer.window)
    return out, AttentionPart("swa", k[total - m:].clone(), v[total - m:].clone(), total - m)


def _linear_alone(mixer: LinearMixer, h: torch.Tensor, positions: torch.Tensor, tail0: int, backend: str,
                  state_dtype: torch.dtype, keep_end_state: bool, pending: list):
    total = h.shape[0]
    conv_in, extras = mixer.project(h[None])
    extras["positions"] = positions  # the alone positions (a layer with RoPE inside the recurrence reads them)
    conv_tail = None
    if mixer.conv is not None:
        conv_out, _ = mixer.conv(conv_in, None)
        r = min(total, mixer.conv.width - 1)
        conv_tail = conv_in[0, total - r:].transpose(0, 1).contiguous()  # [C, r]
    else:
        conv_out = conv_in
    inp = mixer.prepare(conv_out, extras)
    zero = torch.zeros(1, *mixer.state_shape, dtype=torch.float32, device=h.device)
    o, state = mixer.run_recurrence(inp, zero, backend)
    out = mixer.output(o, extras)[0]

    tail_state = None
    same = False
    transitions = None
    if tail0 < total:
        tail = inp.slice_time(tail0, total)
        if tail0 == 0:
            tail_state, same = state, True
        else:
            _, tail_state = mixer.run_recurrence(tail, zero, backend)
        transitions = _tail_transitions(mixer, [tail], backend, state_dtype)
    part = LinearPart(
        family=mixer.family,
        state=state[0].to(state_dtype),
        tail_state=None if tail_state is None else tail_state[0].to(state_dtype),
        tail_transition=None,
        live_heads=None,
        conv_tail=conv_tail,
        tail_state_is_state=same,
    )
    if same:
        part.tail_state = part.state
    if not keep_end_state:
        part.state, part.tail_state_is_state = None, False
    if transitions is not None:
        transitions.attach([part], pending)
    return out, part


# ------------------------------------------------------------------ several segments, one pass
def compute_signatures(model: HybridDecoder, segments: Sequence[tuple[Sequence[int], int]],
                       anchor_ids: Sequence[int] = (), backend: str = "torch",
                       state_dtype: torch.dtype = torch.float32,
                       keep_end_state: bool = True,
                       should_stop: Optional[Callable[[], bool]] = None,
                       tail_states: str = "fla") -> list[SegmentSignature]:
    """The signatures of several segments `(token_ids, split)`, each computed alone behind
    `anchor_ids` exactly as `compute_signature` computes it, in ONE pass through the
    layers: the alone passes are packed one after another, attention runs per segment
    (each attends only to itself), and the linear recurrences run as fla varlen calls
    (one per layer for the passes, one for the tails: E_tail, and for the delta rule T
    with it) or, on the torch backend, per segment. A cold request with m missing segments pays
    one pass of per-call overhead instead of m. `tail_states`: PicConfig.tail_states."""
    return _run_to_end(AlonePass(model, segments, anchor_ids, backend, state_dtype, keep_end_state, tail_states),
                       should_stop)


def _run_to_end(alone: "AlonePass", should_stop: Optional[Callable[[], bool]]) -> list[SegmentSignature]:
    if not alone.run(should_stop):
        raise AlonePassStopped(f"alone pass stopped before layer {alone.layer}")
    return alone.signatures()


class AlonePass:
    """The (packed) alone pass of `segments` `(token_ids, split)`, run a layer at a time:
    `run(should_stop)` runs layers until the pass is done (True) or, between two layers,
    `should_stop()` says a request is due (False); a later `run` resumes where it
    stopped, so idle work that gives way to requests loses nothing. `signatures()` once
    done. One segment runs exactly `compute_signature`'s single pass; several, the
    packed pass (`compute_signatures`). The pass keeps its own tensors (the hidden
    states and the layers' parts so far): a suspended pass holds them until resumed.
    `tail_states` (PicConfig.tail_states): how a packed pass on fla gets its
    scalar/diagonal-decay tails' E_tail (`tails_from_zero`)."""

    def __init__(self, model: HybridDecoder, segments: Sequence[tuple[Sequence[int], int]],
                 anchor_ids: Sequence[int] = (), backend: str = "torch", state_dtype: torch.dtype = torch.float32,
                 keep_end_state: bool = True, tail_states: str = "fla") -> None:
        segs = [(list(t), int(s)) for t, s in segments]
        if not segs:
            raise SignatureFormatError("an alone pass needs at least one segment")
        a = len(anchor_ids)
        for toks, split in segs:
            _check_segment(len(toks), split, keep_end_state)
        self.model, self.segs, self.anchor_len = model, segs, a
        self.backend, self.state_dtype, self.keep_end_state = backend, state_dtype, keep_end_state
        self.tail_states = tail_states
        self.tokens = sum(a + len(t) for t, _ in segs)
        device = model.device
        with torch.inference_mode():
            if len(segs) == 1:
                ids = torch.tensor([*anchor_ids, *segs[0][0]], dtype=torch.long, device=device)
                model._check_ids(ids)
                self.positions = torch.arange(ids.shape[0], device=device)
                self.pack = None
                self.tail0 = a + min(segs[0][1], len(segs[0][0]))
            else:
                lens = [a + len(t) for t, _ in segs]
                starts = [0]
                for n in lens:
                    starts.append(starts[-1] + n)
                ids_host = torch.tensor([i for t, _ in segs for i in (*anchor_ids, *t)], dtype=torch.long)
                model._check_ids(ids_host)
                ids = ids_host.to(device)
                self.positions = torch.cat([torch.arange(n) for n in lens]).to(device)
                self.pack = _Pack(starts, lens, [a + min(split, len(t)) for t, split in segs])
            self.x = model.embed(ids)
        self.parts: list[list] = [[] for _ in segs]
        #: delta layers' operators whose live heads are read once, at the end (settle_transitions)
        self.pending: list = []
        #: the next layer to run
        self.layer = 0

    @property
    def done(self) -> bool:
        return self.layer == len(self.model.blocks)

    def run(self, should_stop: Optional[Callable[[], bool]] = None) -> bool:
        """Run layers until done (True) or until `should_stop()` says stop, asked before
        every layer but the first this call runs (False: call again to resume). On CUDA,
        with `should_stop`, the host keeps at most one layer queued ahead of the device,
        so a request that stops the pass waits for one layer, not for the queued rest."""
        cuda = self.model.device.type == "cuda" and should_stop is not None
        behind = None
        first = True
        with torch.inference_mode():
            while not self.done:
                if not first and should_stop is not None:
                    if behind is not None:  # pragma: no cover - GPU only
                        behind.synchronize()
                    if should_stop():
                        return False
                first = False
                mark = None
                if cuda:  # pragma: no cover - GPU only
                    mark = torch.cuda.Event()
                    mark.record()
                self._step()
                behind = mark
        return True

    def _step(self) -> None:
        i, model = self.layer, self.model
        block = model.blocks[i]
        h = block.mixer_norm(self.x)
        mixer = block.mixer
        if isinstance(mixer, LinearMixer):
            if self.pack is None:
                mixed, part = _linear_alone(mixer, h, self.positions, self.tail0, self.backend, self.state_dtype,
                                            self.keep_end_state, self.pending)
                got = [part]
            else:
                mixed, got = _linear_alone_packed(mixer, h, self.positions, self.pack, self.backend, self.state_dtype,
                                                  self.keep_end_state, self.pending, self.tail_states)
        elif isinstance(mixer, Attention):
            if self.pack is None:
                mixed, part = _attention_alone(mixer, h, self.positions)
                got = [part]
            else:
                mixed, got = _attention_alone_packed(mixer, h, self.positions, self.pack)
        else:  # pragma: no cover - every mixer is one of the two
            raise SignatureFormatError(f"layer {i}: mixer {type(mixer).__name__} has no PIC signature")
        for j, p in enumerate(got):
            self.parts[j].append(p)
        if i < len(model.blocks) - 1:
            self.x = block._finish(self.x, mixed)
        else:
            self.x = None  # nothing after the last mixer is needed
        self.layer += 1

    def signatures(self) -> list[SegmentSignature]:
        if not self.done:
            raise RuntimeError(f"alone pass not done: at layer {self.layer} of {len(self.model.blocks)}")
        settle_transitions(self.pending)
        return [SegmentSignature(len(t), self.anchor_len, split, tuple(p)) for (t, split), p in zip(self.segs, self.parts)]


class _Pack:
    """Where each packed alone pass lies: [starts[j], starts[j] + lens[j]), tail from tail0[j]."""

    def __init__(self, starts: list[int], lens: list[int], tail0: list[int]) -> None:
        self.starts, self.lens, self.tail0 = starts, lens, tail0

    def __len__(self) -> int:
        return len(self.lens)

    def span(self, j: int) -> tuple[int, int]:
        return self.starts[j], self.starts[j] + self.lens[j]

    def cu(self, lens: Sequence[int]) -> torch.Tensor:
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.long)


def _attention_alone_packed(mixer: Attention, h: torch.Tensor, positions: torch.Tensor, pack: _Pack):
    q, k, v, gate = mixer.project(h, positions)
    outs, parts = [], []
    for j in range(len(pack)):
        s, e = pack.span(j)
        pos = positions[s:e]
        outs.append(mixer.attend_prefill(q[s:e], k[s:e], v[s:e], pos, pos))
        if mixer.window is None:
            parts.append(AttentionPart("full", k[s:e].clone(), v[s:e].clone(), 0))
        else:
            m = min(e - s, mixer.window)
            parts.append(AttentionPart("swa", k[e - m:e].clone(), v[e - m:e].clone(), e - s - m))
    return mixer.output(torch.cat(outs), gate), parts


def _linear_alone_packed(mixer: LinearMixer, h: torch.Tensor, positions: torch.Tensor, pack: _Pack, backend: str,
                         state_dtype: torch.dtype, keep_end_state: bool, pending: list, tail_mode: str = "fla"):
    m = len(pack)
    conv_in, extras = mixer.project(h[None])
    extras["positions"] = positions  # each segment's own alone positions
    conv_tails: list = [None] * m
    if mixer.conv is not None:
        outs = []
        for j in range(m):
            s, e = pack.span(j)
            out, _ = mixer.conv(conv_in[:, s:e], None)
            outs.append(out)
            r = min(e - s, mixer.conv.width - 1)
            conv_tails[j] = conv_in[0, e - r:e].transpose(0, 1).contiguous()
        conv_out = torch.cat(outs, dim=1)
    else:
        conv_out = conv_in
    inp = mixer.prepare(conv_out, extras)
    shape = mixer.state_shape
    dev = h.device
    if backend == "fla" and fla_backend.has_kernel(mixer.family):
        o, states = fla_backend.fla_chunk(mixer.family, inp, None, cu_seqlens=pack.cu(pack.lens))
        states = [states[j:j + 1] for j in range(m)]
    else:
        zero = torch.zeros(1, *shape, dtype=torch.float32, device=dev)
        os_, states = [], []
        for j in range(m):
            s, e = pack.span(j)
            oj, sj = mixer.run_recurrence(inp.slice_time(s, e), zero, backend)
            os_.append(oj)
            states.append(sj)
        o = torch.cat(os_, dim=1)
    out = mixer.output(o, extras)[0]

    # tails: E_tail (from zero) and T_tail of every segment with a tail, batched
    has_tail = [j for j in range(m) if pack.tail0[j] < pack.lens[j]]
    from_start = [j for j in has_tail if pack.tail0[j] == 0]
    cut = [j for j in has_tail if pack.tail0[j] > 0]
    tails = {j: inp.slice_time(pack.starts[j] + pack.tail0[j], pack.starts[j] + pack.lens[j]) for j in has_tail}
    tail_states: dict[int, torch.Tensor] = {j: states[j] for j in from_start}
    dense = None
    span = {j: (pack.starts[j] + pack.tail0[j], pack.starts[j] + pack.lens[j]) for j in has_tail}
    if has_tail and backend == "fla" and mixer.family in DENSE_FAMILIES and fla_backend.has_kernel(mixer.family):
        # E_tail and T of every tail in ONE varlen call over the packed inputs as they lie
        e_tail, dense = tails_from_zero(mixer, inp, [span[j] for j in has_tail], backend)
        tail_states.update({j: e for j, e in zip(has_tail, e_tail) if j in cut})
    elif cut:
        tail_states.update(zip(cut, tails_from_zero(mixer, inp, [span[j] for j in cut], backend, tail_mode)[0]))
    transitions = _tail_transitions(mixer, [tails[j] for j in has_tail], backend, state_dtype, dense)
    parts = []
    for j in range(m):
        tail_state = None
        same = j in from_start
        if j in tails:
            tail_state = tail_states[j]
        part = LinearPart(
            family=mixer.family,
            state=states[j][0].to(state_dtype),
            tail_state=None if tail_state is None else tail_state[0].to(state_dtype),
            tail_transition=None,
            live_heads=None,
            conv_tail=conv_tails[j],
            tail_state_is_state=same,
        )
        if same:
            part.tail_state = part.state
        if not keep_end_state:
            part.state, part.tail_state_is_state = None, False
        parts.append(part)
    if transitions is not None:
        transitions.attach([parts[j] for j in has_tail], pending)
    return out, parts


def tails_from_zero(mixer: LinearMixer, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]],
                    backend: str, tail_mode: str = "fla") -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
    """E `[1, H, dk, dv]` (float32) of each range `[a, b)` of `inp`'s time axis run from zero
    state (ranges sorted and disjoint), and for the delta rule on fla the dense operators
    `[n, H, dk, dk]` of the same ranges from the same varlen call (else None): the alone
    pass's tails, and the tails of misses computed in context (engine.pic.capture).
    On fla at most one varlen call for all ranges; none for scalar/diagonal decay with
    `tail_mode` "direct" (PicConfig.tail_states): each E as one decay-weighted sum
    (linear_ops.end_state_from_zero); on torch one recurrence per range."""
    if not ranges:
        return [], None
    if backend == "fla" and mixer.family in DENSE_FAMILIES and fla_backend.has_kernel(mixer.family):
        dense, e = long_ranges.delta_operators(inp, ranges, family=mixer.family)
        return [e[i:i + 1] for i in range(len(ranges))], dense
    tails = [inp.slice_time(a, b) for a, b in ranges]
    if backend == "fla" and tail_mode == "direct" and mixer.family not in DENSE_FAMILIES:
        # scalar/diagonal decay: no second fla call
        return [end_state_from_zero(mixer.family, t) for t in tails], None
    if backend == "fla" and fla_backend.has_kernel(mixer.family):
        cu = [0]
        for a, b in ranges:
            cu.append(cu[-1] + b - a)
        _, st = fla_backend.fla_chunk(mixer.family, _cat_inputs(tails), None,
                                      cu_seqlens=torch.tensor(cu, dtype=torch.long))
        return [st[i:i + 1] for i in range(len(ranges))], None
    zero = torch.zeros(1, *mixer.state_shape, dtype=torch.float32, device=inp.q.device)
    return [mixer.run_recurrence(t, zero, backend)[1] for t in tails], None


def _cat_inputs(inps: list[RecurrenceInputs]) -> RecurrenceInputs:
    first = inps[0]
    return RecurrenceInputs(
        q=torch.cat([i.q for i in inps], dim=1), k=torch.cat([i.k for i in inps], dim=1),
        v=torch.cat([i.v for i in inps], dim=1), log_decay=torch.cat([i.log_decay for i in inps], dim=1),
        beta=None if first.beta is None else torch.cat([i.beta for i in inps], dim=1), scale=first.scale)


class ScalarTransitions:
    """Log-decay sums of scalar/diagonal-decay tails: known at once."""

    def __init__(self, log_sums: list[torch.Tensor]) -> None:
        self.log_sums = log_sums

    def attach(self, parts: list, pending: list) -> None:
        for part, ls in zip(parts, self.log_sums):
            part.tail_transition = ls


class PendingTransitions:
    """Dense delta-rule operators of one layer's tails, `[m, H, dk, dk]`, and which heads
    stay live (`[m, H]`, on the device). Their parts get them when `settle_transitions`
    reads every layer's live masks in one host sync at the end of the pass (no per-layer
    device reads: the host keeps launching while the device computes)."""

    def __init__(self, dense: torch.Tensor, live: torch.Tensor) -> None:
        self.dense, self.live, self.parts = dense, live, []

    def attach(self, parts: list, pending: list) -> None:
        self.parts = parts
        pending.append(self)


def settle_transitions(pending: list[PendingTransitions]) -> None:
    """Give every pending delta part its live heads and operator rows: a head whose decay
    product underflowed, or whose operator is exactly 0, has forgotten its prefix."""
    if not pending:
        return
    live = torch.cat([p.live for p in pending])
    lives = live.cpu().tolist()  # one sync for every layer
    # each row's live heads first, in head order: the rows to keep are a slice of it, so
    # no head list is copied to the device (a blocking copy, i.e. a sync, per part)
    order = None
    row = 0
    for p in pending:
        for i, part in enumerate(p.parts):
            heads = tuple(h for h, alive in enumerate(lives[row + i]) if alive)
            part.live_heads = heads
            if not heads:
                part.tail_transition = None
            elif len(heads) == p.dense.shape[1]:
                part.tail_transition = p.dense[i]
            else:
                if order is None:
                    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)
                part.tail_transition = p.dense[i].index_select(0, order[row + i, :len(heads)])
        row += len(p.parts)
    pending.clear()


def _tail_transitions(mixer: LinearMixer, tails: list[RecurrenceInputs], backend: str, state_dtype: torch.dtype,
                      dense: Optional[torch.Tensor] = None):
    """T_tail of every tail without reading the device: scalar/diag log-decay sums at
    once; delta operators of every tail (`dense` when already computed: the packed pass
    on fla, long_ranges.delta_operators) with their live heads left on the device (`settle_transitions`). None
    without tails."""
    if not tails:
        return None
    if mixer.family not in DENSE_FAMILIES:
        return ScalarTransitions([t.log_decay.to(torch.float32).sum(dim=1)[0].contiguous() for t in tails])
    log_sums = head_log_sums(mixer.family, torch.stack([t.log_decay.to(torch.float32).sum(dim=1)[0]
                                                        for t in tails]))  # [m, H]
    if dense is None:  # a single segment's tail, or the torch backend
        dense = torch.cat([mixer.transition_operator(x, backend) for x in tails])
    live = (log_sums >= LOG_FLOAT32_TINY) & (dense.abs().amax(dim=(2, 3)) > 0)
    return PendingTransitions(dense.to(state_dtype), live)
