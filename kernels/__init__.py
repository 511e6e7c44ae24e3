"""Triton kernels of the engine, each beside its torch reference.

Every kernel module exposes `xxx_reference(...)` (torch) and `xxx(...)`, which runs the
Triton kernel on CUDA tensors or under TRITON_INTERPRET=1 and the reference otherwise
(`force_triton=True/False` overrides; see `kernels.backend`).
"""
from kernels.errors import KernelError, KernelInputError, KernelUnavailableError
from kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    ring_block_tables,
)
from kernels.rope_scatter import (
    apply_rope_reference,
    ring_slot_mapping,
    rope_delta_cos_sin,
    rope_inv_freq,
    rope_scatter,
    rope_scatter_reference,
)
from kernels.state_compose import state_compose, state_compose_reference, transition_kind

__all__ = [
    "KernelError",
    "KernelInputError",
    "KernelUnavailableError",
    "apply_rope_reference",
    "default_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ring_block_tables",
    "ring_slot_mapping",
    "rope_delta_cos_sin",
    "rope_inv_freq",
    "rope_scatter",
    "rope_scatter_reference",
    "state_compose",
    "state_compose_reference",
    "transition_kind",
]
