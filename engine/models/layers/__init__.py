"""Token mixers and their building blocks.

Per-layer hooks for position-independent caching (each module's docstring has the detail):

| kind                 | module            | get a segment's cacheable parts                     | write them into a request |
|----------------------|-------------------|-----------------------------------------------------|---------------------------|
| `full`               | attention.py      | `Attention.project(x, arange(n))` -> K at base 0, V | `PagedKVCache.write(flat_slots, k, v)` after `rope_shift(k, offset)` |
| `swa`                | attention.py      | same, last `window` tokens                          | `WindowRingCache.write(slot, positions, k, v)` |
| `gdn` `gla` `lightning` `mamba2` `kda` | linear_base.py (+ family module) | `project` -> `apply_conv(., zero tail)` -> `prepare` gives `RecurrenceInputs`; `linear_ops.transition_operator(family, inp)` gives T, `run_recurrence(inp, None, backend)[1]` gives E; conv tail = last conv-1 rows of `conv_in` | `StateSlotCache.set_state(slot, S)`, `set_conv_tail(slot, tail)`; compose with `linear_ops.apply_transition` |

`LinearMixer.summarize_segment(h, backend)` does the linear row in one call (T, E, conv tail
of a segment run alone; `transition_operator(inp, backend="fla")` uses fla's chunk kernel
from S0 = I, v = 0 for the delta rule and kda). A `full` layer may be multi-head latent
attention (mla.py, `LatentAttention`): the same hooks, its K/V expanded per head. `HybridDecoder.prefill/forward(...,
mixer_input_hook=...)` hands each layer's normalised input to a callback, so all of the
above comes from one pass. A lightning layer with RoPE on q/k (`uses_positions`, Ring-linear)
takes the tokens' positions in `extras["positions"]` before `prepare`, and its E moves to
an offset with `rotate_state(E, delta)`.
"""
