"""Tests of kernels.hisparse_select: the block-scoring and top-k Triton kernels against their
torch references on fresh random inputs (fp32/fp16), the references against a direct
per-block computation over the keys, and input validation."""
import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.hisparse_select import block_scores, block_scores_reference, topk_blocks, topk_blocks_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def _summaries_from_keys(keys, mode):
    """keys [S, N, block, Hkv, D] -> summaries [S, N, 2, Hkv, D]."""
    if mode == "minmax":
        return torch.stack([keys.amin(2), keys.amax(2)], dim=2)
    return torch.stack([keys.mean(2), torch.zeros_like(keys[:, :, 0])], dim=2)


def _inputs(gen, dtype, slots_n=3, blocks=21, block=4, hkv=2, group=4, d=24, mode="minmax"):
    keys = torch.randn(slots_n, blocks, block, hkv, d, generator=gen)
    summ = _summaries_from_keys(keys, mode)
    q = torch.randn(4, hkv * group, d, generator=gen)
    slots = torch.tensor([2, 0, 1, 2])
    lo = torch.tensor([1, 0, 2, 1])
    hi = torch.tensor([20, 7, 21, 1])  # last row: nothing live
    to = dict(device=DEVICE, dtype=dtype)
    return keys, q.to(**to), summ.to(**to), slots.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE)


@pytest.mark.parametrize("mode", ["minmax", "mean"])
def test_reference_scores_bound_or_match_per_block_dot_products(mode):
    gen = torch.Generator().manual_seed(3)
    keys, q, summ, slots, lo, hi = _inputs(gen, torch.float32, mode=mode)
    got = block_scores_reference(q.cpu(), summ.cpu(), slots.cpu(), lo.cpu(), hi.cpu(), 21, mode)
    group = q.shape[1] // keys.shape[3]
    for b in range(q.shape[0]):
        for j in range(21):
            if not (lo[b] <= j < hi[b]):
                assert got[b, j] == float("-inf")
                continue
            k = keys[slots[b], j].repeat_interleave(group, dim=1)  # [block, H, D]
            dots = torch.einsum("hd,thd->th", q[b].cpu(), k)  # every key's dot with every head
            if mode == "minmax":  # per head an upper bound of its best dot product, summed over heads
                assert got[b, j] >= dots.amax(0).sum() - 1e-4
            else:  # mean key: per head the mean dot product, summed over heads
                torch.testing.assert_close(got[b, j], dots.mean(0).sum(), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["minmax", "mean"])
def test_triton_scores_match_reference_on_random_inputs(dtype, mode):
    gen = torch.Generator().manual_seed(11 + (dtype == torch.float16) + 2 * (mode == "mean"))
    _, q, summ, slots, lo, hi = _inputs(gen, dtype, mode=mode)
    ref = block_scores_reference(q, summ, slots, lo, hi, 21, mode)
    got = block_scores(q, summ, slots, lo, hi, 21, mode, force_triton=True)
    assert got.dtype == torch.float32 and got.shape == (4, 21)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    live = ~torch.isinf(ref)
    torch.testing.assert_close(got[live], ref[live], rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
def test_triton_scores_read_strided_slot_lo_hi_columns():
    """Slots given as a column of packed decode rows (stride 4, as the runner's DecodeContext
    holds them) score the same as contiguous ones."""
    gen = torch.Generator().manual_seed(5)
    _, q, summ, slots, lo, hi = _inputs(gen, torch.float32)
    packed = torch.stack([hi, slots, lo, slots * 0 + 99], 1)  # [B, 4]: each column strided
    got = block_scores(q, summ, packed[:, 1], packed[:, 2], packed[:, 0], 21, force_triton=True)
    assert packed[:, 1].stride() == (4,)
    ref = block_scores_reference(q, summ, slots, lo, hi, 21)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    live = ~torch.isinf(ref)
    torch.testing.assert_close(got[live], ref[live], rtol=1e-5, atol=1e-5)


def test_reference_topk_is_a_stable_descending_selection():
    scores = torch.tensor([[0.5, 2.0, 2.0, -1.0, float("-inf"), 3.0]])
    assert topk_blocks_reference(scores, 4).tolist() == [[5, 1, 2, 0]]
    assert topk_blocks_reference(scores, 6).tolist() == [[5, 1, 2, 0, 3, 4]]


@needs_triton
@pytest.mark.parametrize("cols,k", [(21, 5), (16, 16), (70, 9)])
def test_triton_topk_matches_reference_on_random_inputs_with_ties_and_masked_columns(cols, k):
    gen = torch.Generator().manual_seed(cols * 31 + k)
    scores = torch.randint(0, 6, (5, cols), generator=gen).float()  # many ties
    scores[torch.rand(5, cols, generator=gen) < 0.3] = float("-inf")
    scores[4] = float("-inf")  # a row with nothing live
    scores = scores.to(DEVICE)
    ref = topk_blocks_reference(scores, k)
    got = topk_blocks(scores, k, force_triton=True)
    assert got.dtype == torch.int64
    assert torch.equal(got, ref)


def test_bad_inputs_raise_naming_the_argument():
    q = torch.zeros(2, 4, 8)
    summ = torch.zeros(3, 5, 2, 2, 8)
    idx = torch.zeros(2, dtype=torch.long)
    with pytest.raises(KernelInputError, match="mode"):
        block_scores(q, summ, idx, idx, idx, 5, "max")
    with pytest.raises(KernelInputError, match="num_cols"):
        block_scores(q, summ, idx, idx, idx, 6)
    with pytest.raises(KernelInputError, match="slots"):
        block_scores(q, summ, torch.tensor([0, 3]), idx, idx, 5)
    with pytest.raises(KernelInputError, match="num_kv_heads"):
        block_scores(torch.zeros(2, 3, 8), summ, idx, idx, idx, 5)
    with pytest.raises(KernelInputError, match="k must be"):
        topk_blocks(torch.zeros(2, 4), 5)
