"""flash-linear-attention (fla-core) dispatch for the linear recurrences on the GPU.

Maps `RecurrenceInputs` (see linear_ops.py) onto fla-core 0.6's kernels, which take
time-first `[B, T, H, D]` tensors, log-space decays, an explicit `scale`, and states in the
default `[N, H, K, V]` layout (`state_v_first=False`) with `initial_state` float32:

| family   | prefill (chunk)                              | decode (one token)                   |
|----------|----------------------------------------------|--------------------------------------|
| `delta`  | `chunk_gated_delta_rule(q,k,v,g,beta)`       | `fused_recurrent_gated_delta_rule`   |
| `diag`   | `chunk_gla(q,k,v,g)`                         | `fused_recurrent_gla(gk=g)`          |
| `scalar` | `chunk_simple_gla(q,k,v,g)`                  | `fused_recurrent_simple_gla(g=g)`    |
| `kda`    | `chunk_kda(q,k,v,g,beta)`                    | `fused_recurrent_kda(q,k,v,g,beta)`  |

`kda` (Kimi Delta Attention) runs through fla only when `fla.ops.kda` imports
(`fla_has_kda`); otherwise `LinearMixer.run_recurrence` takes the torch path for it. The
fla path for `kda` has not been run here (no GPU in CI): only the torch path is tested.

q/k are passed already L2-normalised where the layer wants it (the in-kernel l2norm flag
stays off), beta already through its sigmoid. fla is used only when CUDA is available and
the package imports; `linear_backend()` names the path a call takes.

Varlen calls without a host sync: fla 0.6's `chunk_simple_gla` and `chunk_gla` state pass
(`fla.ops.common.chunk_h.chunk_fwd_h`) reads the number of state splits back from the
device (`split_offsets[-1].item()`), one host-device sync per varlen call even when the
caller hands it `cu_seqlens_cpu`, and a sync stops the host from running ahead of the
device (a ring-bench alone pass, whose every linear layer makes varlen calls, showed 109
syncs). `fla_chunk` therefore passes scalar/diagonal-decay varlen calls through
`_chunk_fwd_h_host`, the same kernel launch with the offsets computed from the host copy
of `cu_seqlens` (installed over the name those two modules import when its signature
matches fla's; otherwise fla's own function runs, with its sync). Measured on an H200
(tools/check_long_ranges_gpu.py, ring-bench, scalar long ranges in shared varlen calls):
117 ms with it, 121 ms with fla's sync.
"""
from __future__ import annotations

import functools
import inspect
import threading

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


@functools.lru_cache(maxsize=1)
def fla_has_kda() -> bool:
    """Whether fla-core has the Kimi Delta Attention kernels (`fla.ops.kda`, fla-core 0.6)."""
    if not fla_importable():
        return False
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401
    except Exception:  # an fla without kda (older) -> torch path for kda layers
        return False
    return True


def has_kernel(family: str) -> bool:
    """Whether `fla_chunk` / `fla_recurrent` serve `family` (fla assumed importable)."""
    return family != "kda" or fla_has_kda()


def import_in_background() -> threading.Thread:
    """Start importing fla (`fla_importable`) in a daemon thread and return it: the import
    takes seconds (fla.ops pulls in torch._dynamo and every op family), which a caller
    overlaps with other start-up work (engine.builder: the model load) and then joins
    before anything asks `resolve_backend`."""
    thread = threading.Thread(target=fla_importable, name="fla-import", daemon=True)
    thread.start()
    return thread


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


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (index lists, cu_seqlens) on `device` without a host sync: on
    CUDA through pinned memory, copied asynchronously in stream order (the caching host
    allocator keeps the pinned block until the copy has run). A blocking host -> device
    copy waits for every kernel queued before it; in a pass that queues a layer's kernels
    ahead of the device, each such copy stalls the host until the device catches up."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # pragma: no cover - GPU only


#: fla's chunk size for the delta rule's varlen calls (chunk_gated_delta_rule's default)
DELTA_CHUNK = 64


def _prep(inp: RecurrenceInputs, initial_state: torch.Tensor | None):
    dtype = inp.v.dtype
    q = inp.q.to(dtype).contiguous()
    k = inp.k.to(dtype).contiguous()
    v = inp.v.contiguous()
    g = inp.log_decay.to(torch.float32).contiguous()
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    return q, k, v, g, s0


#: the host copy of the running varlen call's cu_seqlens (per thread), for _chunk_fwd_h_host
_HOST_CU = threading.local()
#: fla's chunk_fwd_h parameters that _chunk_fwd_h_host reproduces
_CHUNK_FWD_H_PARAMS = ("k", "v", "g", "g_gamma", "gk", "gv", "h0", "output_final_state", "state_v_first",
                       "cu_seqlens", "chunk_size", "split_size", "states_in_fp32")


def _chunk_fwd_h_host(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, output_final_state=False,
                      state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None, states_in_fp32=False):
    """fla.ops.common.chunk_h.chunk_fwd_h (fla-core 0.6) with a varlen call's chunk offsets
    from the host copy of cu_seqlens `fla_chunk` set: the same kernel launch, no device read."""
    import triton
    from fla.ops.common import chunk_h

    cpu = getattr(_HOST_CU, "cu", None)
    if cu_seqlens is None or cpu is None or cpu.numel() != cu_seqlens.numel():
        return chunk_h.chunk_fwd_h(k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv, h0=h0,
                                   output_final_state=output_final_state, state_v_first=state_v_first,
                                   cu_seqlens=cu_seqlens, chunk_size=chunk_size, split_size=split_size,
                                   states_in_fp32=states_in_fp32)
    B, T, H, K, V = *k.shape, v.shape[-1]
    BT = chunk_size
    BS = BT if split_size is None else split_size
    assert BS % BT == 0, f"split_size={BS} must be a multiple of chunk_size={BT}"
    splits = torch.nn.functional.pad((cpu[1:] - cpu[:-1] + BS - 1) // BS, (1, 0)).cumsum(-1)  # prepare_chunk_offsets
    N, NS = cpu.numel() - 1, int(splits[-1])
    split_offsets = splits.to(k.device, non_blocking=True)
    state_shape = (V, K) if state_v_first else (K, V)
    h = k.new_empty(B, NS, H, *state_shape, dtype=k.dtype if not states_in_fp32 else torch.float)
    ht = k.new_empty(N, H, *state_shape, dtype=torch.float) if output_final_state else None

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)

    chunk_h.chunk_fwd_kernel_h[grid](
        k=k, v=v, h=h, g=g, g_gamma=g_gamma, gk=gk, gv=gv, h0=h0, ht=ht, cu_seqlens=cu_seqlens,
        split_offsets=split_offsets, T=T, H=H, K=K, V=V, BT=BT, BS=BS, USE_G=g is not None,
        USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None, USE_GV=gv is not None, STATE_V_FIRST=state_v_first)
    return h, ht


@functools.lru_cache(maxsize=1)
def install_host_offsets() -> bool:
    """Put `_chunk_fwd_h_host` where fla's simple_gla and gla chunk modules look up
    chunk_fwd_h (once). False, and fla untouched, when fla's function has other parameters."""
    from fla.ops.common import chunk_h
    from fla.ops.gla import chunk as gla_chunk
    from fla.ops.simple_gla import chunk as simple_gla_chunk

    if tuple(inspect.signature(chunk_h.chunk_fwd_h).parameters) != _CHUNK_FWD_H_PARAMS:
        return False
    simple_gla_chunk.chunk_fwd_h = _chunk_fwd_h_host
    gla_chunk.chunk_fwd_h = _chunk_fwd_h_host
    return True


def fla_chunk(family: str, inp: RecurrenceInputs, initial_state: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill through fla. Returns (o `[B, T, H, V]`, final state float32).
    `cu_seqlens` (int64 `[N+1]`, on the CPU): B = 1 holds N packed sequences, each run from
    its own initial state (`[N, H, K, V]` or None) to its own final state `[N, H, K, V]`."""
    q, k, v, g, s0 = _prep(inp, initial_state)
    var = {}
    if cu_seqlens is not None:
        cpu = cu_seqlens.to("cpu", torch.long)
        var = dict(cu_seqlens=host_to_device(cpu, q.device), cu_seqlens_cpu=cpu)
    if family == "delta":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        if var:  # fla builds them from the host copy but moves them with a blocking copy
            from fla.ops.utils.index import prepare_chunk_indices
            var["chunk_indices"] = host_to_device(prepare_chunk_indices(cpu, DELTA_CHUNK, cu_seqlens_cpu=cpu),
                                                  q.device)
        beta = inp.beta.to(v.dtype).contiguous()
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, scale=inp.scale, initial_state=s0,
                                      output_final_state=True, **var)
    elif family == "kda":
        from fla.ops.kda import chunk_kda
        beta = inp.beta.to(v.dtype).contiguous()
        o, s = chunk_kda(q, k, v, g, beta, scale=inp.scale, initial_state=s0, output_final_state=True, **var)
    elif family in ("diag", "scalar"):
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla

        if var:
            install_host_offsets()
        _HOST_CU.cu = var.get("cu_seqlens_cpu")
        try:
            if family == "diag":
                o, s = chunk_gla(q, k, v, g, scale=inp.scale, initial_state=s0, output_final_state=True, **var)
            else:
                o, s = chunk_simple_gla(q, k, v, g=g, scale=inp.scale, initial_state=s0,
                                        output_final_state=True, **var)
        finally:
            _HOST_CU.cu = None
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
    elif family == "kda":
        from fla.ops.kda import fused_recurrent_kda
        beta = inp.beta.to(v.dtype).contiguous()
        o, s = fused_recurrent_kda(q, k, v, g, beta, scale=inp.scale, initial_state=s0, output_final_state=True)
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
