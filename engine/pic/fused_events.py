"""The fused step's events (engine.pic.fused): a request's items in prompt order as the
linear layers walk them. `Computed` is a computed range, `lo`/`hi` its local offsets
into C (the computed positions, concatenated) and `end` its absolute end in the prompt;
`Placed` is a spliced piece and its index among the step's pieces."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from engine.pic.splice import SplicePiece


@dataclass(frozen=True)
class Computed:
    lo: int
    hi: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Placed:
    piece: SplicePiece
    index: int


Event = Union[Computed, Placed]
