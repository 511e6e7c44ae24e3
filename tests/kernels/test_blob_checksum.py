"""Tests of kernels.blob_checksum: the kvsum64 Triton kernel against its torch reference
on fresh random inputs (any length, including the zero-padded last word), the reference
against a plain-Python reading of the definition, and the checksum's error detection."""
import os

import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.blob_checksum import BLOCK, ITERS, kvsum64, kvsum64_finish, kvsum64_partial, kvsum64_reference
from kernels.errors import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1


def _python_kvsum(data: bytes) -> int:
    """The module docstring's definition, word by word in Python integers."""
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)

    padded = data + b"\0" * ((-len(data)) % 4)
    s = 0
    for i in range(len(padded) // 4):
        w = int.from_bytes(padded[4 * i: 4 * i + 4], "little")
        x = w ^ ((i & M32) * 0x9E3779B1 & M32) ^ ((i >> 32) * 0x85EBCA77 & M32)
        s += (fmix(x) << 32) | fmix((x * 0x27D4EB2F + 0x165667B1) & M32)
    return kvsum64_finish(s & M64, len(data))


def _random(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("n", [1, 3, 4, 5, 4096, BLOCK * 4 + 6, BLOCK * ITERS * 4 * 2 + 3])
def test_triton_kernel_matches_the_torch_reference_on_fresh_random_bytes(n):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(2):
        buf = _random(n, gen)
        assert kvsum64(buf, force_triton=True) == kvsum64_reference(buf)


@needs_triton
def test_triton_kernel_on_an_offset_slice_of_a_larger_buffer_matches_the_reference():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    big = _random(20_000, gen)
    part = big[4096: 4096 + 9_999]
    assert kvsum64(part, force_triton=True) == kvsum64_reference(part)


def test_reference_matches_the_definition_computed_in_python_integers():
    gen = torch.Generator().manual_seed(7)
    for n in (0, 1, 2, 7, 64, 1001):
        data = bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).tolist())
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        assert kvsum64_reference(buf) == _python_kvsum(data), n


def test_partial_sums_of_word_aligned_chunks_add_up_to_the_whole():
    gen = torch.Generator().manual_seed(11)
    buf = torch.randint(0, 256, (10_003,), dtype=torch.uint8, generator=gen)
    cut = 4 * 1234
    total = (kvsum64_partial(buf[:cut], 0) + kvsum64_partial(buf[cut:], cut // 4)) & M64
    assert kvsum64_finish(total, buf.numel()) == kvsum64_reference(buf)


def test_every_single_byte_change_swap_and_trailing_zero_changes_the_sum():
    gen = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (257,), dtype=torch.uint8, generator=gen)
    base = kvsum64_reference(buf)
    for i in range(buf.numel()):
        flipped = buf.clone()
        flipped[i] ^= 1 << (i % 8)
        assert kvsum64_reference(flipped) != base, i
    swapped = buf.clone()
    swapped[:4], swapped[4:8] = buf[4:8].clone(), buf[:4].clone()
    assert kvsum64_reference(swapped) != base
    assert kvsum64_reference(torch.cat([buf, torch.zeros(1, dtype=torch.uint8)])) != base


def test_bad_input_is_refused_naming_the_problem():
    with pytest.raises(KernelInputError, match="uint8"):
        kvsum64(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(KernelInputError, match="contiguous"):
        kvsum64(torch.zeros(8, dtype=torch.uint8)[::2])


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices: a buffer on one while the other is current")
def test_a_buffer_on_another_device_than_the_current_one_is_summed_on_its_own():
    # an engine on cuda:1 checks a blob it wrote into the daemon's GPU tier on cuda:0
    gen = torch.Generator().manual_seed(7)
    buf = torch.randint(0, 256, (BLOCK * ITERS * 4 + 5,), dtype=torch.uint8, generator=gen).to("cuda:0")
    want = kvsum64_reference(buf.cpu())
    with torch.cuda.device(1):
        assert kvsum64(buf, force_triton=True) == want
