"""flash-linear-attention (fla-core) dispatch for the linear recurrences on the GPU.

Maps `RecurrenceInputs` (see linear_ops.py) onto fla-core 0.6's kernels, which take
time-first `[B, T, H, D]` tensors, log-space decays, an explicit `scale`, and states in the
default `[N, H, K, V]` layout (`state_v_first=False`) with `initial_state` float32:

| family   | prefill (chunk)                              | decode (one token)                   |
|----------|----------------------------------------------|--------------------------------------|
| `delta`  | `chunk_gated_delta_rule(q,k,v,g,beta)`       | `fused_recurrent_gated_delta_rule`   |
| `diag`   | `chunk_gla(q,k,v,g)`                         | `fused_recurrent_gla(gk=g)`          |
| `scalar` | `chunk_simple_gla(q,k,v,g)`                  | `fused_recurrent_simple_gla(g=g)`    |

q/k are passed already L2-normalised where the layer wants it (the in-kernel l2norm flag
stays off), beta already through its sigmoid. fla is used only when CUDA is available and
the package imports; `linear_backend()` names the path a call takes.
"""
from __future__ import annotations

import functools

import torch

from engine.models.layers.linear_ops import RecurrenceInputs

BACKENDS = ("auto", "torch", "fla")


@functools.lru_cache(maxsize=1)
def fla_importable() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.gla  # noqa: F401
        import fla.ops.simple_gla  # noqa: F401
    except Exception:  # any import failure (missing package, triton mismatch) -> torch path
        return False
    return True


def resolve_backend(requested: str, device: torch.device) -> str:
    """'torch' or 'fla' for a request of 'auto' | 'torch' | 'fla' on `device`."""
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} must be one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "torch":
        return "torch"
    if requested == "fla":
        if not on_cuda or not fla_importable():
            raise RuntimeError(
                f"backend='fla' needs CUDA and an importable fla-core (device={device}, "
                f"fla importable={fla_importable()})")
        return "fla"
    return "fla" if on_cuda and fla_importable() else "torch"


def _prep(inp: RecurrenceInputs, initial_state: torch.Tensor | None):
    dtype = inp.v.dtype
    q = inp.q.to(dtype).contiguous()
    k = inp.k.to(dtype).contiguous()
    v = inp.v.contiguous()
    g = inp.log_decay.to(torch.float32).contiguous()
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    return q, k, v, g, s0


def fla_chunk(family: str, inp: RecurrenceInputs, initial_state: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill through fla. Returns (o `[B, T, H, V]`, final state float32).
    `cu_seqlens` (int64 `[N+1]`, on the CPU): B = 1 holds N packed sequences, each run from
    its own initial state (`[N, H, K, V]` or None) to its own final state `[N, H, K, V]`."""
    q, k, v, g, s0 = _prep(inp, initial_state)
    var = {}
    if cu_seqlens is not None:
        cpu = cu_seqlens.to("cpu", torch.long)
        var = dict(cu_seqlens=cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cpu)
    if family == "delta":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        beta = inp.beta.to(v.dtype).contiguous()
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, scale=inp.scale, initial_state=s0,
                                      output_final_state=True, **var)
    elif family == "diag":
        from fla.ops.gla import chunk_gla
        o, s = chunk_gla(q, k, v, g, scale=inp.scale, initial_state=s0, output_final_state=True, **var)
    elif family == "scalar":
        from fla.ops.simple_gla import chunk_simple_gla
        o, s = chunk_simple_gla(q, k, v, g=g, scale=inp.scale, initial_state=s0,
                                output_final_state=True, **var)
    else:
        raise ValueError(f"recurrence family={family!r} has no fla kernel")
    return o, s.to(torch.float32)


def fla_recurrent(family: str, inp: RecurrenceInputs,
                  initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-recurrent form through fla's fused kernels (the decode step, T == 1)."""
    q, k, v, g, s0 = _prep(inp, initial_state)
    if family == "delta":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        beta = inp.beta.to(v.dtype).contiguous()
        o, s = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=inp.scale,
                                                initial_state=s0, output_final_state=True)
    elif family == "diag":
        from fla.ops.gla import fused_recurrent_gla
        o, s = fused_recurrent_gla(q, k, v, gk=g, scale=inp.scale, initial_state=s0,
                                   output_final_state=True)
    elif family == "scalar":
        from fla.ops.simple_gla import fused_recurrent_simple_gla
        o, s = fused_recurrent_simple_gla(q, k, v, g=g, scale=inp.scale, initial_state=s0,
                                          output_final_state=True)
    else:
        raise ValueError(f"recurrence family={family!r} has no fla kernel")
    return o, s.to(torch.float32)
