"""Writing segment signatures into a request's caches at an offset.

A `SplicePiece` places one signature. Its *placement*:
- `first=True`: the segment starts the prompt right behind the anchor (offset = a). The
  alone pass then *is* the real computation of positions [0, a+n): every K/V row is
  written at its own position (delta 0), every linear state is set to E, every conv tail
  to the segment's. Bit-identical to a plain prefill of that chunk.
- `first=False`: the segment sits at `offset` after other content, and its head
  [0, split) was (or will be: the planner orders it first) recomputed in context. The
  tail rows (alone positions a+split .. a+n-1) are written at absolute positions
  alone + (offset - a): full-attention keys re-rotated by that delta and scattered into
  the paged pool (kernels.rope_scatter), sliding-window rows that are among the last
  `window` positions into the ring (same kernel, `ring_slot_mapping`), linear states
  composed from the state the caches hold now, S = T_tail S + E_tail
  (kernels.state_compose; `linear="add"` is naive addition S + E_tail), conv tails
  extended by the tail's last pre-conv inputs. A linear layer with RoPE inside its
  recurrence (Ring-linear's lightning layers) first rotates E_tail by the delta
  (`R_delta E_tail`: the tail's keys move from their alone positions by delta; the
  scalar decay commutes with the rotation).

`splice(manager, model, seq, pieces)` writes a run of contiguous pieces (positions
`seq.num_computed_tokens` onwards; only the first piece may be `first`), all layers,
batching each layer's rows into one kernel call and each linear family's states into one
composition; then advances `seq.num_computed_tokens` to the end of the run.

Layer kinds: each kind's part of a splice is one function, found by the cache the kind
keeps in `SPLICE_LAYERS` (the one dispatch on layer kind here; engine.pic.fused's
`FUSED_LAYERS` is the same table for the fused pass). A new layer kind registers its
splice behaviour there; a linear kind whose states compose adds its layers to
`_Splice.families` and they are composed per family after the per-layer pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.cache.layer_caches import PagedKVCache, StateSlotCache, WindowRingCache
from engine.cache.manager import CacheManager
from engine.models.decoder import HybridDecoder
from engine.models.layers.base import ExternalKVCache
from engine.pic.errors import SplicePlacementError
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature
from engine.runtime.sequence import Sequence as CacheSequence
from kernels import ring_slot_mapping, rope_scatter, state_compose

LINEAR_MODES = ("compose", "add")


@dataclass(frozen=True)
class SplicePiece:
    """One signature placed at `offset` (absolute position of its first segment token)."""

    signature: SegmentSignature
    offset: int
    first: bool = False
    linear: str = "compose"  # "compose" (exact) or "add" (naive addition); unused when first

    @property
    def start(self) -> int:
        """First absolute position this piece writes."""
        return 0 if self.first else self.offset + self.signature.tail_start

    @property
    def end(self) -> int:
        return self.offset + self.signature.num_tokens

    @property
    def delta(self) -> int:
        """Absolute position minus alone position of every row."""
        return self.offset - self.signature.anchor_len

    @property
    def first_row(self) -> int:
        """First alone position written."""
        return 0 if self.first else self.signature.anchor_len + self.signature.tail_start

    def validate(self) -> None:
        sig = self.signature
        if self.linear not in LINEAR_MODES:
            raise SplicePlacementError(f"linear={self.linear!r} must be one of {LINEAR_MODES}")
        if self.first and not sig.has_end_state:
            raise SplicePlacementError("the signature keeps no end states, so it cannot be placed first")
        if self.first and not sig.placeable_first:
            raise SplicePlacementError("the signature keeps only its tail's attention rows (a context signature of "
                                       "a later placement), so it cannot be placed first")
        if self.first and self.offset != sig.anchor_len:
            raise SplicePlacementError(
                f"a first piece sits right behind the anchor (offset {sig.anchor_len}), got offset {self.offset}")
        if not self.first and self.delta + self.first_row < 0:
            raise SplicePlacementError(f"offset {self.offset} puts rows before position 0")
        if not self.first and sig.tail_len == 0:
            raise SplicePlacementError("the signature's tail is empty: nothing to splice after a seam")


def force_triton_for(kernel: str, device: torch.device) -> Optional[bool]:
    """kernels' `force_triton` for a PicConfig.kernel setting: "auto" runs Triton on CUDA
    and the torch references on the CPU (even under the interpreter)."""
    if kernel == "torch":
        return False
    if kernel == "triton":
        return True
    return None if device.type == "cuda" else False


def splice(manager: CacheManager, model: HybridDecoder, seq: CacheSequence, pieces: Sequence[SplicePiece],
           kernel: str = "auto") -> None:
    """Write `pieces` into `seq`'s caches (module docstring)."""
    if not pieces:
        return
    pos = seq.num_computed_tokens
    for i, p in enumerate(pieces):
        p.validate()
        if p.first and i:
            raise SplicePlacementError("only the first piece of a run can be a first placement")
        if p.start != pos:
            raise SplicePlacementError(
                f"piece {i} starts at position {p.start} but the caches hold {pos} positions")
        if len(p.signature.layers) != len(manager.layers):
            raise SplicePlacementError(
                f"signature has {len(p.signature.layers)} layers, the model {len(manager.layers)}")
        pos = p.end
    manager.ensure_capacity(seq, pos)
    sp = _Splice(manager, model, seq, pieces, force_triton_for(kernel, manager.device))
    for i, cache in enumerate(manager.layers):
        layer = SPLICE_LAYERS.get(type(cache)) or (_external_layer if isinstance(cache, ExternalKVCache) else None)
        if layer is None:
            raise SplicePlacementError(f"layer {i}: cache {type(cache).__name__} has no splice (SPLICE_LAYERS)")
        layer(sp, i, cache, model.mixer(i))
    for layer_ids in sp.families.values():
        _splice_states(manager, seq, layer_ids, pieces, sp.force, {i: model.mixer(i) for i in layer_ids})
    seq.num_computed_tokens = pos


@dataclass
class _Splice:
    """What every layer of one splice run shares."""

    manager: CacheManager
    model: HybridDecoder
    seq: CacheSequence
    pieces: Sequence[SplicePiece]
    force: Optional[bool]
    families: dict[str, list[int]] = field(default_factory=dict)  # linear layers by family, composed last


def _full_layer(sp: _Splice, layer: int, cache: PagedKVCache, mixer) -> None:
    _splice_full(sp.manager, sp.seq, cache, mixer, layer, sp.pieces, sp.force)


def _external_layer(sp: _Splice, layer: int, cache: ExternalKVCache, mixer) -> None:
    """A full-attention layer kept outside the paged pool (HiSparse): the pieces' rows,
    re-rotated, appended at the sequence's next positions (a splice run is contiguous)."""
    start = sp.seq.num_computed_tokens
    n = sp.pieces[-1].end - start
    kb, vb = external_rows(sp.pieces, layer, mixer, start, n, sp.model.dtype, sp.manager.device, sp.force)
    if kb is not None:
        cache.append(sp.seq.slot, kb, vb)


def external_rows(pieces, layer: int, mixer, start: int, n: int, dtype: torch.dtype, device: torch.device,
                  force) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The pieces' full-attention rows of `layer`, re-rotated to their positions, in a dense
    K/V buffer `[n, Hkv, D]` of positions `start..start+n-1` (None, None: no rows; positions
    no piece holds stay zero for the caller to fill)."""
    rows = piece_rows(pieces, layer, "full")
    if rows is None:
        return None, None
    k, v, pos, deltas = rows
    if int(pos.min()) < start or int(pos.max()) >= start + n:
        raise SplicePlacementError(f"layer {layer}: piece rows at positions {int(pos.min())}..{int(pos.max())} "
                                   f"outside [{start}, {start + n})")
    kb = torch.zeros(n, 1, *k.shape[1:], dtype=dtype, device=device)
    vb = torch.zeros(n, 1, *v.shape[1:], dtype=dtype, device=device)
    slots = (pos - start).to(device)
    scatter_rows(k.to(device), v.to(device), kb, vb, slots, deltas.to(device), mixer, force)
    return kb[:, 0], vb[:, 0]


def _window_layer(sp: _Splice, layer: int, cache: WindowRingCache, mixer) -> None:
    _splice_window(sp.seq, cache, mixer, layer, sp.pieces, sp.force)


def _linear_layer(sp: _Splice, layer: int, cache: StateSlotCache, mixer) -> None:
    """Conv tails now; the layer's states are composed with its family's after the pass."""
    sp.families.setdefault(mixer.family, []).append(layer)
    _splice_conv(sp.seq, cache, layer, sp.pieces)


#: each layer kind's part of a splice, by the cache the kind keeps: the one place splice
#: dispatches on layer kind (a new family adds its entry here, and in fused.FUSED_LAYERS)
SPLICE_LAYERS: dict[type, Callable[[_Splice, int, object, object], None]] = {
    PagedKVCache: _full_layer, WindowRingCache: _window_layer, StateSlotCache: _linear_layer}


# ----------------------------------------------------------------------- attention layers
def attention_part(piece: SplicePiece, layer: int, kind: str) -> AttentionPart:
    """The attention part of `piece` at `layer`, of `kind` (SplicePlacementError otherwise)."""
    part = piece.signature.layers[layer]
    if not isinstance(part, AttentionPart) or part.kind != kind:
        raise SplicePlacementError(f"layer {layer}: signature holds {type(part).__name__}, the model {kind} attention")
    return part


def piece_rows(pieces, layer, kind):
    """Rows of every piece that this splice writes: (k, v, absolute positions, deltas)."""
    ks, vs, poss, deltas = [], [], [], []
    for p in pieces:
        part = attention_part(p, layer, kind)
        lo = max(p.first_row - part.first_pos, 0)
        if lo >= part.num_rows:
            continue
        ks.append(part.k[lo:])
        vs.append(part.v[lo:])
        alone = torch.arange(part.first_pos + lo, part.first_pos + part.num_rows, device=part.k.device)
        poss.append(alone + p.delta)
        deltas.append(torch.full_like(alone, p.delta))
    if not ks:
        return None
    return torch.cat(ks), torch.cat(vs), torch.cat(poss), torch.cat(deltas)


def scatter_rows(k, v, k_pages, v_pages, slots, deltas, mixer, force) -> None:
    """Rows `k`, `v` into `*_pages` at flat `slots`, keys re-rotated by `deltas`."""
    rot = 2 * mixer.inv_freq.numel()
    if rot == 0:  # no RoPE: positions do not enter K
        keep = slots >= 0
        flat = slots[keep]
        k_pages.view(-1, *k_pages.shape[2:])[flat] = k[keep].to(k_pages.dtype)
        v_pages.view(-1, *v_pages.shape[2:])[flat] = v[keep].to(v_pages.dtype)
        return
    single = bool((deltas == deltas[0]).all())
    offset = int(deltas[0]) if single else deltas
    rope_scatter(k, v, k_pages, v_pages, slots, offset, rotary_dim=rot, inv_freq=mixer.inv_freq,
                 check_slots=False, force_triton=force)


def _splice_full(manager, seq, cache: PagedKVCache, mixer, layer, pieces, force) -> None:
    rows = piece_rows(pieces, layer, "full")
    if rows is None:
        return
    k, v, pos, deltas = rows
    table = torch.tensor(seq.block_table, dtype=torch.long, device=pos.device)
    bs = manager.block_size
    slots = (table[pos // bs] * bs + pos % bs).to(cache.k_pages.device)
    scatter_rows(k, v, cache.k_pages, cache.v_pages, slots, deltas.to(slots.device), mixer, force)


def _splice_window(seq, cache: WindowRingCache, mixer, layer, pieces, force) -> None:
    rows = piece_rows(pieces, layer, "swa")
    if rows is None:
        return
    k, v, pos, deltas = rows
    slots = ring_slot_mapping(seq.slot, pos, cache.window).to(cache.k.device)
    scatter_rows(k, v, cache.k, cache.v, slots, deltas.to(slots.device), mixer, force)


# -------------------------------------------------------------------------- linear layers
def linear_part(piece: SplicePiece, layer: int) -> LinearPart:
    """The linear part of `piece` at `layer` (SplicePlacementError when it holds another kind)."""
    part = piece.signature.layers[layer]
    if not isinstance(part, LinearPart):
        raise SplicePlacementError(f"layer {layer}: signature holds {type(part).__name__}, the model a linear layer")
    return part


def _splice_conv(seq, cache: StateSlotCache, layer, pieces) -> None:
    if cache.conv_tail is None:
        return
    width1 = cache.conv_tail.shape[-1]
    cur = cache.conv_tail[seq.slot]
    for p in pieces:
        tail = linear_part(p, layer).conv_tail
        if tail is None:
            raise SplicePlacementError(f"layer {layer}: signature has no conv tail, the model's layer has a conv")
        tail = tail.to(cur.dtype)
        if p.first:
            cur = torch.cat([torch.zeros_like(cur), tail], dim=1)[:, -width1:]
        else:
            take = min(tail.shape[1], p.signature.tail_len)
            cur = torch.cat([cur, tail[:, tail.shape[1] - take:]], dim=1)[:, -width1:]
    cache.conv_tail[seq.slot] = cur


def _rotated(E: torch.Tensor, mixers: list, pieces: Sequence[SplicePiece]) -> torch.Tensor:
    """E `[pieces, layers, H, dk, dv]` of tails computed at their alone positions, moved
    to where the pieces sit: a layer with RoPE inside its recurrence (`uses_positions`)
    rotates each piece's E by that piece's delta (`R_delta E`); others are unchanged."""
    if not any(getattr(m, "uses_positions", False) for m in mixers):
        return E
    deltas = torch.tensor([p.delta for p in pieces], device=E.device)
    return torch.stack([m.rotate_state(E[:, j], deltas) if getattr(m, "uses_positions", False) else E[:, j]
                        for j, m in enumerate(mixers)], dim=1)


def _splice_states(manager, seq, layer_ids: list[int], pieces, force, mixers: dict) -> None:
    caches = [manager.layers[i] for i in layer_ids]
    rest = list(pieces)
    if rest[0].first:
        for i, c in zip(layer_ids, caches):
            c.state[seq.slot] = linear_part(rest[0], i).state.to(torch.float32)
        rest = rest[1:]
    if not rest:
        return
    naive = [p.linear == "add" for p in rest]
    if any(naive) and not all(naive):
        raise SplicePlacementError("one splice run mixes composed and naively added pieces")
    E = torch.stack([torch.stack([linear_part(p, i).tail_state.float() for i in layer_ids]) for p in rest])
    E = _rotated(E, [mixers[i] for i in layer_ids], rest)
    T = None
    if not naive[0]:
        T = torch.stack([torch.stack([linear_part(p, i).transition_f32() for i in layer_ids]) for p in rest])
    S0 = torch.stack([c.state[seq.slot] for c in caches])
    E, S0 = E.to(S0.device), S0.contiguous()
    out = state_compose(E, None if T is None else T.to(S0.device), S0, force_triton=force)
    for j, c in enumerate(caches):
        c.state[seq.slot] = out[j]
