"""`Sequence`: one request's handle on the engine caches. It owns nothing itself; the
`CacheManager` fills it on `allocate` and empties it on `free`.

- `slot`: index of the request's linear-layer state slots and sliding-window rings (-1 when
  not allocated);
- `block_table`: paged-KV block ids of its full-attention layers, in position order
  (position p lives in `block_table[p // block_size]` at offset `p % block_size`);
- `num_computed_tokens`: how many positions (0..n-1) the caches hold. The runner advances
  it; position-independent caching may set it after splicing cached K/V and states in.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Sequence:
    seq_id: str
    slot: int = -1
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def is_allocated(self) -> bool:
        return self.slot >= 0
