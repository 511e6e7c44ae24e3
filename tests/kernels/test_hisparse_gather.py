"""Tests of kernels.hisparse_gather.copy_blocks: the Triton row-copy kernel against its torch
reference on fresh random inputs (masked entries copy nothing, rows of every element size
copy bit-exactly), on CUDA also from and to pinned host memory, and input validation."""
import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.hisparse_gather import copy_blocks, copy_blocks_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")


def _case(gen, dtype, src_rows=9, dst_rows=7, m=6, row=(5, 2, 12)):
    src = torch.randn(src_rows, *row, generator=gen).to(dtype)
    dst = torch.randn(dst_rows, *row, generator=gen).to(dtype)
    s = torch.randint(0, src_rows, (m,), generator=gen)
    d = torch.randperm(dst_rows, generator=gen)[:m]  # distinct destinations
    valid = torch.rand(m, generator=gen) < 0.6
    return src, dst, s, d, valid


def test_reference_copies_exactly_the_valid_rows():
    gen = torch.Generator().manual_seed(0)
    src, dst, s, d, valid = _case(gen, torch.float32)
    before = dst.clone()
    copy_blocks_reference(src, s, dst, d, valid)
    for i in range(len(s)):
        want = src[s[i]] if valid[i] else before[d[i]]
        assert torch.equal(dst[d[i]], want)
    untouched = torch.ones(dst.shape[0], dtype=torch.bool)
    untouched[d] = False
    assert torch.equal(dst[untouched], before[untouched])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_triton_copy_matches_reference_on_random_inputs(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    src, dst, s, d, valid = _case(gen, dtype, row=(3, 2, 40 + seed))  # row sizes not a multiple of the chunk
    want = copy_blocks_reference(src, s, dst.clone(), d, valid)
    got = copy_blocks(src.to(DEVICE), s.to(DEVICE), dst.to(DEVICE), d.to(DEVICE), valid.to(DEVICE),
                      force_triton=True, splits=1 + seed % 3)
    assert torch.equal(got.cpu(), want)


@needs_triton
def test_triton_copy_with_nothing_valid_leaves_dst_alone():
    gen = torch.Generator().manual_seed(4)
    src, dst, s, d, _ = _case(gen, torch.float32)
    before = dst.clone()
    got = copy_blocks(src.to(DEVICE), s.to(DEVICE), dst.to(DEVICE), d.to(DEVICE),
                      torch.zeros(len(s), dtype=torch.bool, device=DEVICE), force_triton=True)
    assert torch.equal(got.cpu(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host <-> device copies need CUDA")
def test_cuda_copy_reads_and_writes_pinned_host_rows():
    gen = torch.Generator().manual_seed(5)
    src, dst, s, d, valid = _case(gen, torch.bfloat16)
    want = copy_blocks_reference(src, s, dst.clone(), d, valid)
    host_src = src.pin_memory()
    got = copy_blocks(host_src, s.cuda(), dst.cuda(), d.cuda(), valid.cuda())
    assert torch.equal(got.cpu(), want)
    host_dst = dst.clone().pin_memory()
    copy_blocks(src.cuda(), s.cuda(), host_dst, d.cuda(), valid.cuda())
    torch.cuda.synchronize()
    assert torch.equal(host_dst, want)


def test_bad_inputs_raise_naming_the_argument():
    src, dst = torch.zeros(4, 8), torch.zeros(4, 8)
    idx, ok = torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(KernelInputError, match="row shape"):
        copy_blocks(src, idx, torch.zeros(4, 9), idx, ok)
    with pytest.raises(KernelInputError, match="dtype"):
        copy_blocks(src, idx, dst.half(), idx, ok)
    with pytest.raises(KernelInputError, match="valid"):
        copy_blocks(src, idx, dst, idx, torch.tensor([1, 1]))
    with pytest.raises(KernelInputError, match="dst_rows"):
        copy_blocks(src, idx, dst, torch.tensor([0]), ok)
    with pytest.raises(KernelInputError, match="src_rows must lie"):
        copy_blocks_reference(src, torch.tensor([0, 4]), dst, idx, ok)
