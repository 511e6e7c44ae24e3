"""kvsum64: a 64-bit checksum of a byte buffer that a GPU computes at memory speed.

Owns the device-side checksum of kvstore objects that live in GPU memory (the GPU tier,
`put_tensors` from CUDA tensors): hashing them with xxh3 means copying every byte to the
host first (~1 GB/s end to end on an H200), while this sum runs in one pass over device
memory. The Triton kernel (`kvsum64`) and its torch reference (`kvsum64_reference`, also
the host implementation) compute the same integer bit for bit on any input.

Definition (all word arithmetic mod 2**32, the sum mod 2**64). The buffer of n bytes is
read as little-endian uint32 words w_0 .. w_{W-1}, W = ceil(n / 4), the last word
zero-padded. For word index i (lo, hi = its low and high 32 bits)::

    x_i = w_i ^ (lo * 0x9E3779B1) ^ (hi * 0x85EBCA77)       position-keyed word
    a_i = fmix32(x_i),  b_i = fmix32(x_i * 0x27D4EB2F + 0x165667B1)
    S   = sum over i of (a_i << 32 | b_i)                      mod 2**64
    kvsum64 = fmix64(S ^ (n * 0x9E3779B97F4A7C15 mod 2**64))

with fmix32/fmix64 the MurmurHash3 finalizers. fmix32 and x -> x * odd + c are
bijections, so changing any single word always changes S; a change spread over many
words collides with probability about 2**-64; reordering words changes their keys; the
length term separates buffers that differ only by trailing zero bytes. It is a checksum
against corruption (torn writes, stale or zeroed pages, bit flips), not a MAC.

The sum is order-independent, so the kernel splits the words over programs, each writes
a partial sum, and the partials add up on the device: deterministic, no atomics, and
streamable (`kvsum64_partial(chunk, start_word)` for a chunk starting at a word index).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from kernels.backend import HAS_TRITON, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = ["kvsum64", "kvsum64_reference", "kvsum64_partial", "kvsum64_finish", "MASK64"]

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
_K_LO, _K_HI = 0x9E3779B1, 0x85EBCA77
_B_MUL, _B_ADD = 0x27D4EB2F, 0x165667B1
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_LEN_MUL = 0x9E3779B97F4A7C15

BLOCK = 1024  # words per step of one program
ITERS = 16  # steps per program: 64 KiB of input each
_REF_CHUNK_WORDS = 1 << 18  # the reference works in 1 MiB pieces (bounded int64 temporaries)


def _check(buf: torch.Tensor, name: str = "buf") -> None:
    if not isinstance(buf, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise KernelInputError(f"{name} must be a contiguous 1-D uint8 tensor, got {buf.dtype} "
                               f"{tuple(buf.shape)}{'' if buf.is_contiguous() else ' (not contiguous)'}")


def kvsum64_finish(partial: int, nbytes: int) -> int:
    """The checksum of `nbytes` bytes whose word sum S (mod 2**64) is `partial`."""
    k = (partial ^ (nbytes * _LEN_MUL)) & MASK64
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK64
    k ^= k >> 33
    return k


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _F1) & MASK32
    h = h ^ (h >> 13)
    h = (h * _F2) & MASK32
    return h ^ (h >> 16)


def _words_ref(u8: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 words of `u8` (zero-padded to a multiple of 4) as int64."""
    n = u8.numel()
    pad = (-n) % 4
    if pad:
        u8 = torch.cat([u8, torch.zeros(pad, dtype=torch.uint8, device=u8.device)])
    b = u8.view(-1, 4).to(torch.int64)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _sum_words_ref(w: torch.Tensor, start_word: int) -> int:
    i = torch.arange(start_word, start_word + w.numel(), dtype=torch.int64, device=w.device)
    x = w ^ ((i & MASK32) * _K_LO & MASK32) ^ ((i >> 32) * _K_HI & MASK32)
    a = _fmix32_ref(x)
    b = _fmix32_ref((x * _B_MUL + _B_ADD) & MASK32)
    v = (a << 32) | b  # int64 two's complement: the same 64 bits as the unsigned value
    return int(v.sum().item()) & MASK64


def kvsum64_partial(buf: torch.Tensor, start_word: int = 0) -> int:
    """The word sum S (mod 2**64) of `buf` taken as the words starting at index
    `start_word` of a longer buffer (torch, any device). Only the last chunk of a
    stream may have a length that is not a multiple of 4."""
    _check(buf)
    if start_word < 0:
        raise KernelInputError(f"start_word must be >= 0, got {start_word}")
    total = 0
    n = buf.numel()
    step = _REF_CHUNK_WORDS * 4
    for off in range(0, n, step):
        w = _words_ref(buf[off: off + step])
        total += _sum_words_ref(w, start_word + off // 4)
    return total & MASK64


def kvsum64_reference(buf: torch.Tensor) -> int:
    """kvsum64 of a uint8 tensor with torch ops (any device): the reference."""
    return kvsum64_finish(kvsum64_partial(buf), buf.numel())


if HAS_TRITON:

    @triton.jit
    def _fmix32(h, f1, f2):
        h = h ^ (h >> 16)
        h = h * f1
        h = h ^ (h >> 13)
        h = h * f2
        return h ^ (h >> 16)

    @triton.jit
    def _kvsum_kernel(words_ptr, out_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * (BLOCK * ITERS)
        lane = tl.arange(0, BLOCK).to(tl.int64)
        k_lo = tl.full([BLOCK], 0x9E3779B1, tl.uint32)
        k_hi = tl.full([BLOCK], 0x85EBCA77, tl.uint32)
        b_mul = tl.full([BLOCK], 0x27D4EB2F, tl.uint32)
        b_add = tl.full([BLOCK], 0x165667B1, tl.uint32)
        f1 = tl.full([BLOCK], 0x85EBCA6B, tl.uint32)
        f2 = tl.full([BLOCK], 0xC2B2AE35, tl.uint32)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for it in range(ITERS):
            idx = base + it * BLOCK + lane
            mask = idx < n_words
            w = tl.load(words_ptr + idx, mask=mask, other=0).to(tl.uint32, bitcast=True)
            lo = idx.to(tl.uint32)
            hi = (idx >> 32).to(tl.uint32)
            x = w ^ (lo * k_lo) ^ (hi * k_hi)
            a = _fmix32(x, f1, f2)
            b = _fmix32(x * b_mul + b_add, f1, f2)
            v = (a.to(tl.uint64) << 32) | b.to(tl.uint64)
            acc += tl.where(mask, v, tl.zeros([BLOCK], dtype=tl.uint64))
        tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def _device_of(buf: torch.Tensor):
    """Make `buf`'s CUDA device current for a launch (nothing to do off CUDA)."""
    return torch.cuda.device(buf.device) if buf.is_cuda else contextlib.nullcontext()


def kvsum64(buf: torch.Tensor, *, force_triton: Optional[bool] = None) -> int:
    """kvsum64 of a contiguous 1-D uint8 tensor: the Triton kernel for CUDA tensors (or
    under TRITON_INTERPRET=1), the torch reference otherwise (see `backend.use_triton`).

    The kernel reads whole 4-byte words, so it needs the buffer 4-byte aligned in memory;
    an unaligned CUDA buffer goes through the reference (same result, slower)."""
    _check(buf)
    n = buf.numel()
    if n == 0 or not use_triton([buf], force_triton, "kvsum64"):
        return kvsum64_reference(buf)
    if buf.data_ptr() % 4:
        if force_triton:
            raise KernelInputError(f"kvsum64: buffer at address {buf.data_ptr():#x} is not 4-byte aligned")
        return kvsum64_reference(buf)
    n_words = n // 4
    partial = 0
    if n_words:
        words = buf[: n_words * 4].view(torch.int32)
        per_program = BLOCK * ITERS
        grid = (triton.cdiv(n_words, per_program),)
        # Triton launches on the current device, not the tensor's: a client whose current
        # device is its engine's GPU sums blobs in the daemon's GPU tier on another one
        with _device_of(buf):
            out = torch.empty(grid[0], dtype=torch.int64, device=buf.device)
            _kvsum_kernel[grid](words, out, n_words, BLOCK=BLOCK, ITERS=ITERS)
            partial = int(out.sum().item())
    if n % 4:  # the zero-padded last word
        partial += _sum_words_ref(_words_ref(buf[n_words * 4:]), n_words)
    return kvsum64_finish(partial & MASK64, n)
