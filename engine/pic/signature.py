"""`SegmentSignature`: what one cached segment holds, per decoder layer, so that it can be
spliced into any request at any offset; its byte accounting; and its form as a flat dict
of named tensors plus a small msgpack-able meta dict (the kvstore blob format carries
exactly that: `plan_blob(tensors, meta=meta, layers=layer_of)`).

A segment of n tokens is computed alone (engine.pic.compute): behind the engine's anchor
(the a = 0 or 1 tokens every prompt starts with, BOS by default), at alone positions
0..a+n-1, from zero state. `split` (the seam) cuts its n tokens into a head [0, split),
recomputed in context when the segment is spliced after another one, and a tail
[split, n), reused. Per layer:

| layer | part | shape | meaning |
|---|---|---|---|
| full attention | `k`, `v` | `[a+n, Hkv, D]` | K rotated at its alone position, V |
| sliding window | `k`, `v` | `[m, Hkv, D]`, m = min(a+n, w) | the last m alone positions (`first_pos` = a+n-m) |
| linear | `state` | `[H, dk, dv]` | E: the state at the end of the alone pass (anchor included); optional |
| linear | `tail_state` | `[H, dk, dv]` | E_tail: the state over tail tokens only, from zero |
| linear | `tail_transition` | scalar `[H]`, diag `[H, dk]` (log-decay sums), delta and kda `[h', dk, dk]` | T_tail over the tail tokens |
| linear | `conv_tail` | `[C, r]`, r = min(a+n, conv-1) | the last r pre-conv inputs |

Delta-rule operators are stored only for the heads whose decay product over the tail has
not underflowed (`live_heads`); a forgotten head's T is exactly 0 (its norm is bounded by
exp(sum of log decays) < the smallest normal float32), and a layer whose heads are all
forgotten stores no T at all. When a = 0 and split = 0 the tail is the whole alone pass,
so `tail_state` is `state` (stored once). E serves only a segment placed first (right
behind the anchor); a signature computed with `keep_end_state=False` omits it (a third
of the linear bytes) and is then placed like any later segment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from engine.pic.errors import SignatureFormatError

FORMAT = "pic-signature-v1"
FAMILIES = ("scalar", "diag", "delta", "kda")
#: families whose T_tail is a dense `[H, dk, dk]` (stored for the live heads only)
DENSE_FAMILIES = ("delta", "kda")


@dataclass
class AttentionPart:
    """K/V rows of one attention layer; row i sits at alone position `first_pos + i`."""

    kind: str  # "full" | "swa"
    k: torch.Tensor
    v: torch.Tensor
    first_pos: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.k.shape[0])

    def nbytes(self) -> int:
        return _nbytes(self.k) + _nbytes(self.v)


@dataclass
class LinearPart:
    """What one linear-attention layer needs (module docstring)."""

    family: str
    state: Optional[torch.Tensor]
    tail_state: Optional[torch.Tensor]
    tail_transition: Optional[torch.Tensor]
    live_heads: Optional[tuple[int, ...]] = None  # delta only
    conv_tail: Optional[torch.Tensor] = None
    tail_state_is_state: bool = False

    @property
    def _ref(self) -> torch.Tensor:
        t = self.state if self.state is not None else self.tail_state
        if t is None:
            raise SignatureFormatError("a linear part needs a state or a tail state")
        return t

    @property
    def num_heads(self) -> int:
        return int(self._ref.shape[0])

    def transition_f32(self) -> torch.Tensor:
        """T_tail in the form kernels.state_compose takes, float32: log sums `[H]` /
        `[H, dk]`, or the dense `[H, dk, dk]` with forgotten heads as exact zeros."""
        if self.family not in DENSE_FAMILIES:
            return self.tail_transition.float()
        h, dk = self.num_heads, int(self._ref.shape[1])
        if self.tail_transition is not None and self.live_heads is not None and len(self.live_heads) == h:
            return self.tail_transition.float()  # every head live: already dense, in order
        dense = torch.zeros(h, dk, dk, dtype=torch.float32, device=self._ref.device)
        if self.tail_transition is not None and self.live_heads:
            idx = torch.tensor(self.live_heads, dtype=torch.long, device=self._ref.device)
            dense[idx] = self.tail_transition.float()
        return dense

    def nbytes_by_part(self) -> dict[str, int]:
        return {
            "linear_state": _nbytes(self.state),
            "linear_tail_state": 0 if self.tail_state_is_state else _nbytes(self.tail_state),
            "linear_transition": _nbytes(self.tail_transition),
            "conv_tail": _nbytes(self.conv_tail),
        }


LayerPart = Union[AttentionPart, LinearPart]


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class SegmentSignature:
    """One segment's signature (module docstring). `layers[i]` is decoder layer i's part."""

    num_tokens: int
    anchor_len: int
    split: int
    layers: tuple[LayerPart, ...]
    meta: dict[str, Any] = field(default_factory=dict)  # free-form (e.g. the model fingerprint)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise SignatureFormatError(f"num_tokens={self.num_tokens} must be >= 1")
        if self.anchor_len < 0 or self.split < 0:
            raise SignatureFormatError(f"anchor_len={self.anchor_len} and split={self.split} must be >= 0")
        self.layers = tuple(self.layers)

    # ------------------------------------------------------------------ queries
    @property
    def tail_start(self) -> int:
        """First token (segment index) of the reusable tail."""
        return min(self.split, self.num_tokens)

    @property
    def tail_len(self) -> int:
        return self.num_tokens - self.tail_start

    @property
    def has_end_state(self) -> bool:
        """Whether every linear layer keeps E (needed to place the segment first)."""
        return all(p.state is not None for p in self.layers if isinstance(p, LinearPart))

    @property
    def placeable_first(self) -> bool:
        """Whether it can start a prompt right behind the anchor, spliced whole: every linear
        layer keeps E and every attention layer the rows from alone position 0 (full: all
        rows; sliding window: rows up to the end). A context signature of a later placement
        (engine.pic.capture) keeps only its tail's rows and no E."""
        if not self.has_end_state:
            return False
        for p in self.layers:
            if isinstance(p, AttentionPart):
                if p.kind == "full" and (p.first_pos != 0 or p.num_rows != self.alone_len):
                    return False
                if p.kind == "swa" and p.first_pos + p.num_rows != self.alone_len:
                    return False
        return self.meta.get("placeable_first", True) is not False

    @property
    def alone_len(self) -> int:
        """Positions of the alone pass: anchor plus segment."""
        return self.anchor_len + self.num_tokens

    @property
    def device(self) -> torch.device:
        for part in self.layers:
            t = part.k if isinstance(part, AttentionPart) else part._ref
            return t.device
        return torch.device("cpu")

    def bytes_by_part(self) -> dict[str, int]:
        """Bytes per kind of part: full_kv, swa_kv, linear_state, linear_tail_state,
        linear_transition, conv_tail."""
        out = dict.fromkeys(("full_kv", "swa_kv", "linear_state", "linear_tail_state",
                             "linear_transition", "conv_tail"), 0)
        for part in self.layers:
            if isinstance(part, AttentionPart):
                out[f"{part.kind}_kv"] += part.nbytes()
            else:
                for name, n in part.nbytes_by_part().items():
                    out[name] += n
        return out

    def nbytes(self) -> int:
        return sum(self.bytes_by_part().values())

    def to(self, device: torch.device | str) -> "SegmentSignature":
        """A copy with every tensor on `device` (self when already there)."""
        device = torch.device(device)
        if self.device == device:
            return self
        tensors, meta, _ = self.to_tensors()
        return SegmentSignature.from_tensors({k: v.to(device) for k, v in tensors.items()}, meta)

    def compacted(self) -> "SegmentSignature":
        """The same signature over one buffer per dtype (one torch.cat each), so it holds
        exactly its own bytes whatever its parts were views of (a context capture's parts
        are views of per-layer batches shared by every capture of the request: a cache
        keeping one would keep them all)."""
        tensors, meta, _ = self.to_tensors()
        names_of: dict[torch.dtype, list[str]] = {}
        for name, t in tensors.items():
            names_of.setdefault(t.dtype, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for names in names_of.values():
            flat = torch.cat([tensors[n].reshape(-1) for n in names])
            at = 0
            for n in names:
                t = tensors[n]
                out[n] = flat[at:at + t.numel()].view(t.shape)
                at += t.numel()
        return SegmentSignature.from_tensors(out, meta)

    # ---------------------------------------------------------- serialisation
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, int]]:
        """(named tensors, meta, part -> layer index). Names are `L<i>.<part>`; `meta`
        holds everything else and is msgpack/JSON-serialisable."""
        tensors: dict[str, torch.Tensor] = {}
        layer_of: dict[str, int] = {}
        layers_meta: list[dict[str, Any]] = []

        def put(i: int, name: str, t: Optional[torch.Tensor]) -> None:
            if t is not None:
                key = f"L{i}.{name}"
                tensors[key] = t.contiguous()
                layer_of[key] = i

        for i, part in enumerate(self.layers):
            if isinstance(part, AttentionPart):
                put(i, "k", part.k)
                put(i, "v", part.v)
                layers_meta.append({"kind": part.kind, "first_pos": part.first_pos})
            elif isinstance(part, LinearPart):
                put(i, "state", part.state)
                if not part.tail_state_is_state:
                    put(i, "tail_state", part.tail_state)
                put(i, "tail_transition", part.tail_transition)
                put(i, "conv_tail", part.conv_tail)
                layers_meta.append({
                    "kind": "linear", "family": part.family,
                    "state": "none" if part.state is None else "stored",
                    "tail_state": "state" if part.tail_state_is_state else
                    ("own" if part.tail_state is not None else "none"),
                    "transition": "none" if part.tail_transition is None else "stored",
                    "live_heads": None if part.live_heads is None else list(part.live_heads),
                })
            else:
                raise SignatureFormatError(f"layer {i}: unknown part type {type(part).__name__}")
        meta = {"format": FORMAT, "num_tokens": self.num_tokens, "anchor_len": self.anchor_len,
                "split": self.split, "layers": layers_meta, "extra": dict(self.meta)}
        return tensors, meta, layer_of

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "SegmentSignature":
        """Inverse of `to_tensors`. The tensors are used as given (views stay views)."""
        if meta.get("format") != FORMAT:
            raise SignatureFormatError(f"signature format {meta.get('format')!r} is not {FORMAT!r}")

        def need(i: int, name: str) -> torch.Tensor:
            key = f"L{i}.{name}"
            if key not in tensors:
                raise SignatureFormatError(f"signature part {key!r} is missing")
            return tensors[key]

        layers: list[LayerPart] = []
        for i, lm in enumerate(meta["layers"]):
            kind = lm.get("kind")
            if kind in ("full", "swa"):
                layers.append(AttentionPart(kind, need(i, "k"), need(i, "v"), int(lm["first_pos"])))
            elif kind == "linear":
                family = lm["family"]
                if family not in FAMILIES:
                    raise SignatureFormatError(f"layer {i}: family {family!r} is not one of {FAMILIES}")
                state = need(i, "state") if lm.get("state", "stored") == "stored" else None
                ts_mode = lm["tail_state"]
                tail_state = state if ts_mode == "state" else (need(i, "tail_state") if ts_mode == "own" else None)
                trans = need(i, "tail_transition") if lm["transition"] == "stored" else None
                live = None if lm.get("live_heads") is None else tuple(int(h) for h in lm["live_heads"])
                layers.append(LinearPart(family, state, tail_state, trans, live,
                                         tensors.get(f"L{i}.conv_tail"), ts_mode == "state"))
            else:
                raise SignatureFormatError(f"layer {i}: unknown kind {kind!r}")
        return cls(int(meta["num_tokens"]), int(meta["anchor_len"]), int(meta["split"]), tuple(layers),
                   dict(meta.get("extra") or {}))
