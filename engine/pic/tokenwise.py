"""The token-wise parts of a one-pass prefill (engine.pic.fused), token-major: the
embedding; each layer's norm and input projections; a linear layer's `prepare`; each
layer's output projection, residual and MLP. With `PrefillStages`
(engine.runtime.prefill_graphs) they run as CUDA graphs per computed-token bucket; what
lies between them (attention, convs across ranges, recurrences, splices) reads their
first n rows. Without, they run plainly, op by op.

Each function here acts on every token alone (no op mixes rows), which is what lets a
graph captured for a bucket of b rows serve any n <= b.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils import _pytree as pytree

from engine.models.decoder import HybridDecoder
from engine.models.layers.attention import Attention
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.runtime.prefill_graphs import PrefillStages


class TokenWise:
    """The token-wise stages of one pass over `n` computed tokens at positions `pos`
    (module docstring); `stages` None runs them plainly."""

    def __init__(self, model: HybridDecoder, stages: Optional[PrefillStages], n: int, pos: torch.Tensor) -> None:
        self.model, self.stages, self.n, self.pos = model, stages, n, pos

    def _run(self, name, fn, inputs: list):
        if self.stages is None:
            return fn(*inputs)
        return self.stages.run(name, fn, inputs, self.n)

    def _wants_pos(self, i: int) -> bool:
        mixer = self.model.blocks[i].mixer
        return isinstance(mixer, Attention) or getattr(mixer, "uses_positions", False)

    def _project(self, i: int, x: torch.Tensor, pos: Optional[torch.Tensor]):
        """Block i's norm and projections of token-major x: attention (q, k, v, gate),
        linear (conv_in `[C, ch]`, extras {name: `[C, ...]`})."""
        block = self.model.blocks[i]
        mixer = block.mixer
        h = block.mixer_norm(x)
        if isinstance(mixer, Attention):
            return mixer.project(h, pos)
        conv_in, extras = mixer.project(h[None])
        extras = {k: t[0] for k, t in extras.items()}
        if pos is not None:  # RoPE inside the recurrence: prepare reads the positions
            extras["positions"] = pos
        return conv_in[0], extras

    def _for_layer(self, i: int, proj):
        if isinstance(self.model.blocks[i].mixer, Attention):
            return proj
        return proj[0][None], proj[1]  # the linear layers' conv code takes [1, C, ch]

    def first(self, ids: torch.Tensor):
        """(x, block 0's projections) of the computed tokens `ids`."""
        want = self._wants_pos(0)

        def fn(ids_, *pos):
            x = self.model.embed(ids_)
            return x, self._project(0, x, pos[0] if want else None)

        x, proj = self._run(("in",), fn, [ids, *([self.pos] if want else [])])
        return x, self._for_layer(0, proj)

    def prepare_of(self, i: int, extras: dict):
        """Layer i's `prepare` as a function of its conv output `[1, C, ch]`."""
        mixer = self.model.blocks[i].mixer
        keys = list(extras)

        def fn(conv_out, *vals):
            ex = {k: v[None] for k, v in zip(keys, vals)}
            inp = mixer.prepare(conv_out[None], ex)
            beta = None if inp.beta is None else inp.beta[0]
            added = {k: t[0] for k, t in ex.items() if k not in keys}  # what prepare keeps for output
            return inp.q[0], inp.k[0], inp.v[0], inp.log_decay[0], beta, inp.scale, added

        def prepare(conv_out: torch.Tensor) -> RecurrenceInputs:
            q, k, v, g, beta, scale, added = self._run(("prep", i), fn, [conv_out[0], *(extras[k] for k in keys)])
            extras.update(added)
            return RecurrenceInputs(q=q[None], k=k[None], v=v[None], log_decay=g[None],
                                    beta=None if beta is None else beta[None], scale=scale)

        return prepare

    def next(self, i: int, x: torch.Tensor, o: torch.Tensor, aux):
        """Layer i's output projection (`o`: its mixer output; `aux`: the gate or the
        extras), residual and MLP, then block i+1's norm and projections: (x, those
        projections, None after the last block)."""
        block = self.model.blocks[i]
        mixer = block.mixer
        attn = isinstance(mixer, Attention)
        last = i == len(self.model.blocks) - 1
        want = not last and self._wants_pos(i + 1)
        leaves, spec = pytree.tree_flatten(aux)
        k = len(leaves)

        def fn(x_, o_, *rest):
            a = pytree.tree_unflatten(list(rest[:k]), spec)
            if attn:
                mixed = mixer.output(o_, a)
            else:
                mixed = mixer.output(o_[None], {name: t[None] for name, t in a.items()})[0]
            y = block._finish(x_, mixed)
            return y, (None if last else self._project(i + 1, y, rest[k] if want else None))

        x, proj = self._run(("next", i), fn, [x, o if attn else o[0], *leaves, *([self.pos] if want else [])])
        return x, (None if last else self._for_layer(i + 1, proj))
