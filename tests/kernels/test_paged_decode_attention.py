"""Tests of kernels.paged_decode_attention: the Triton kernel (single pass and split-K)
against its torch reference, and the reference against dense attention over contiguous
K/V, for GQA ratios 1 and 4, ragged lengths, sliding windows and sliding-window rings."""
import math

import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    ring_block_tables,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _paged_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen, spare_blocks=3):
    """Random q and a shuffled paged pool holding each sequence's K/V; also returns the
    contiguous per-sequence K/V for a dense check. Unused block-table entries are -1."""
    max_blocks = max(-(-L // block_size) for L in seq_lens) + 1
    need = sum(-(-L // block_size) for L in seq_lens)
    num_blocks = need + spare_blocks
    k_pages = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_pages = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    dense = []
    for b, L in enumerate(seq_lens):
        n = -(-L // block_size)
        ids = [perm.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
        idx = torch.tensor(ids, dtype=torch.long)
        dense.append((k_pages[idx].flatten(0, 1)[:L], v_pages[idx].flatten(0, 1)[:L]))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    return (q.to(**to), k_pages.to(**to), v_pages.to(**to), tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), dense)


def _dense_attention(q, dense, window, scale):
    outs = []
    group = q.shape[1] // dense[0][0].shape[1]
    for b, (k, v) in enumerate(dense):
        if window is not None:
            k, v = k[-window:], v[-window:]
        if k.shape[0] == 0:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            continue
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].cpu().double(), k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 13])
def test_reference_equals_dense_attention_over_contiguous_kv(group, window):
    gen = torch.Generator().manual_seed(group * 100 + (window or 0))
    seq_lens = [1, 7, 16, 45, 0]
    q, kp, vp, bt, lens, dense = _paged_batch(seq_lens, 2 * group, 2, 32, 8, torch.float32, gen)
    scale = 0.3
    got = paged_decode_attention_reference(q, kp, vp, bt, lens, scale, window=window)
    want = _dense_attention(q, [(k.float(), v.float()) for k, v in dense], window, scale)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert got[-1].abs().max() == 0  # empty sequence -> zeros


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_reference_on_random_inputs(dtype, group, window, num_splits):
    gen = torch.Generator().manual_seed(1000 * group + 10 * (window or 0) + num_splits + (dtype == torch.float16))
    seq_lens = [5, 37, 64, 0, 19]  # not multiples of block_size, one empty
    q, kp, vp, bt, lens, _ = _paged_batch(seq_lens, 2 * group, 2, 40, 8, dtype, gen)
    ref = paged_decode_attention_reference(q, kp, vp, bt, lens, window=window)
    got = paged_decode_attention(q, kp, vp, bt, lens, window=window, num_splits=num_splits,
                                 force_triton=True)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
def test_triton_split_k_with_more_splits_than_tiles_matches_reference():
    gen = torch.Generator().manual_seed(9)
    q, kp, vp, bt, lens, _ = _paged_batch([3, 40], 4, 1, 16, 4, torch.float32, gen)
    ref = paged_decode_attention_reference(q, kp, vp, bt, lens, 0.5)
    out = torch.empty_like(q)
    got = paged_decode_attention(q, kp, vp, bt, lens, 0.5, num_splits=7, out=out, force_triton=True)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, ref, rtol=TOL[torch.float32], atol=TOL[torch.float32])


@pytest.mark.parametrize("force_triton", [
    pytest.param(True, marks=needs_triton, id="triton"), pytest.param(False, id="reference")])
def test_window_over_ring_buffer_attends_to_last_window_positions(force_triton):
    gen = torch.Generator().manual_seed(4)
    window, num_slots, num_kv_heads, group, head_dim = 8, 3, 2, 4, 16
    seq_lens = [5, 8, 29]  # shorter than, equal to, and past the window (ring wrapped)
    ring_slots = torch.tensor([2, 0, 1])
    k_ring = torch.zeros(num_slots, window, num_kv_heads, head_dim)
    v_ring = torch.zeros_like(k_ring)
    dense = []
    for b, L in enumerate(seq_lens):
        k = torch.randn(L, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(L, num_kv_heads, head_dim, generator=gen)
        for p in range(L):  # write every position, later ones overwrite p % window
            k_ring[ring_slots[b], p % window] = k[p]
            v_ring[ring_slots[b], p % window] = v[p]
        dense.append((k, v))
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    tables = ring_block_tables(ring_slots, max(seq_lens), window)
    got = paged_decode_attention(q.to(DEVICE), k_ring.to(DEVICE), v_ring.to(DEVICE), tables.to(DEVICE),
                                 torch.tensor(seq_lens, device=DEVICE), window=window,
                                 force_triton=force_triton)
    want = _dense_attention(q, dense, window, 1 / math.sqrt(head_dim))
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=2e-5)


def test_bad_inputs_raise_naming_the_argument():
    q = torch.zeros(2, 4, 16)
    pages = torch.zeros(4, 8, 2, 16)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="num_kv_heads"):
        paged_decode_attention(torch.zeros(2, 3, 16), pages, pages, bt, lens)
    with pytest.raises(KernelInputError, match="seq_lens"):
        paged_decode_attention(q, pages, pages, bt, torch.tensor([3, 17], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="block_tables entries"):
        paged_decode_attention(q, pages, pages, torch.full((2, 2), 4, dtype=torch.int32), lens)
    with pytest.raises(KernelInputError, match="dtype"):
        paged_decode_attention(q.half(), pages, pages, bt, lens)
    with pytest.raises(KernelInputError, match="window"):
        paged_decode_attention(q, pages, pages, bt, lens, window=0)
