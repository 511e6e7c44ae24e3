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
from typing import Sequence

import torch

from engine.models.decoder import HybridDecoder
from engine.models.layers.attention import Attention
from engine.models.layers.linear_base import LinearMixer
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.pic.errors import SignatureFormatError
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature

#: log of the smallest normal float32: a head whose tail decay product is below it has
#: forgotten its prefix (||T|| <= exp(sum of log decays) for the gated delta rule).
LOG_FLOAT32_TINY = math.log(torch.finfo(torch.float32).tiny)


@torch.inference_mode()
def compute_signature(model: HybridDecoder, token_ids: Sequence[int], anchor_ids: Sequence[int] = (),
                      split: int = 0, backend: str = "torch", state_dtype: torch.dtype = torch.float32,
                      keep_end_state: bool = True) -> SegmentSignature:
    """The signature of `token_ids` computed alone behind `anchor_ids` (module docstring).
    `split`: seam length; tokens [split, n) form the reusable tail. `backend`: the
    linear-layer backend of the runner ("torch" or "fla"). `keep_end_state`: keep each
    linear layer's end state E (needed only to place the segment first)."""
    n, a = len(token_ids), len(anchor_ids)
    if n < 1:
        raise SignatureFormatError("a segment needs at least one token")
    if split < 0:
        raise SignatureFormatError(f"split={split} must be >= 0")
    if not keep_end_state and split >= n:
        raise SignatureFormatError(f"without end states a signature needs a tail, but split={split} >= n={n}")
    device = model.device
    ids = torch.tensor([*anchor_ids, *token_ids], dtype=torch.long, device=device)
    model._check_ids(ids)
    total = a + n
    tail0 = a + min(split, n)
    positions = torch.arange(total, device=device)
    x = model.embed(ids)
    parts = []
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        h = block.mixer_norm(x)
        mixer = block.mixer
        if isinstance(mixer, LinearMixer):
            mixed, part = _linear_alone(mixer, h, tail0, backend, state_dtype, keep_end_state)
        elif isinstance(mixer, Attention):
            mixed, part = _attention_alone(mixer, h, positions)
        else:  # pragma: no cover - every mixer is one of the two
            raise SignatureFormatError(f"layer {i}: mixer {type(mixer).__name__} has no PIC signature")
        parts.append(part)
        if i < last:
            x = block._finish(x, mixed)
    return SegmentSignature(n, a, split, tuple(parts))


def _attention_alone(mixer: Attention, h: torch.Tensor, positions: torch.Tensor):
    q, k, v, gate = mixer.project(h, positions)
    o = mixer.attend_prefill(q, k, v, positions, positions)
    out = mixer.output(o, gate)
    if mixer.window is None:
        return out, AttentionPart("full", k, v, 0)
    total = k.shape[0]
    m = min(total, mixer.window)
    return out, AttentionPart("swa", k[total - m:].clone(), v[total - m:].clone(), total - m)


def _linear_alone(mixer: LinearMixer, h: torch.Tensor, tail0: int, backend: str, state_dtype: torch.dtype,
                  keep_end_state: bool):
    total = h.shape[0]
    conv_in, extras = mixer.project(h[None])
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

    tail_state = tail_t = live = None
    same = False
    if tail0 < total:
        tail = inp.slice_time(tail0, total)
        if tail0 == 0:
            tail_state, same = state, True
        else:
            _, tail_state = mixer.run_recurrence(tail, zero, backend)
        tail_t, live = _tail_transition(mixer, tail, backend)
    part = LinearPart(
        family=mixer.family,
        state=state[0].to(state_dtype),
        tail_state=None if tail_state is None else tail_state[0].to(state_dtype),
        tail_transition=None if tail_t is None else (tail_t if mixer.family != "delta" else tail_t.to(state_dtype)),
        live_heads=live,
        conv_tail=conv_tail,
        tail_state_is_state=same,
    )
    if same:
        part.tail_state = part.state
    if not keep_end_state:
        part.state, part.tail_state_is_state = None, False
    return out, part


def _tail_transition(mixer: LinearMixer, tail: RecurrenceInputs, backend: str):
    """(T_tail, live heads): log-decay sums for scalar/diag; for delta the dense operator
    of the heads whose decay product has not underflowed (None when none has)."""
    log_sum = tail.log_decay.to(torch.float32).sum(dim=1)[0]  # [H] or [H, dk]
    if mixer.family != "delta":
        return log_sum.contiguous(), None
    live = log_sum >= LOG_FLOAT32_TINY
    if not bool(live.any()):
        return None, ()
    dense = mixer.transition_operator(tail, backend)[0]  # [H, dk, dk]; fla on the GPU
    live &= dense.abs().amax(dim=(1, 2)) > 0
    heads = tuple(int(i) for i in torch.nonzero(live).flatten().tolist())
    if not heads:
        return None, ()
    return dense[list(heads)].contiguous(), heads
