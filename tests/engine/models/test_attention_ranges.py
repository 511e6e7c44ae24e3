"""causal_attention_ranges (the fused prefill's full-attention layers): queries in
host-known runs of positions against keys at 0..L-1 give exactly what causal_attention
gives over the same scattered positions, with GQA and with a window, on fresh inputs."""
from __future__ import annotations

import pytest
import torch

from engine.models.layers import attention
from engine.models.layers.attention import (causal_attention, causal_attention_known, causal_attention_ranges,
                                            one_masked_call, ranges_mask)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="the CUDA form (SDPA lower-right causal) needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("runs", [[(0, 37)], [(20, 37)], [(0, 3), (9, 14), (15, 16), (30, 37)], [(4, 5), (6, 37)]])
def test_runs_of_queries_attend_as_the_scattered_positions_do(runs, window, device):
    g = torch.Generator().manual_seed(sum(a * 31 + b for a, b in runs) + (window or 0))
    lk, h, hkv, d = runs[-1][1], 4, 2, 8
    n = sum(b - a for a, b in runs)
    q = torch.randn(n, h, d, generator=g).to(device)
    k, v = torch.randn(lk, hkv, d, generator=g).to(device), torch.randn(lk, hkv, d, generator=g).to(device)
    pos = torch.cat([torch.arange(a, b) for a, b in runs]).to(device)
    want = causal_attention(q[None].cpu(), k[None].cpu(), v[None].cpu(), pos.cpu(), torch.arange(lk), window,
                            d ** -0.5)[0]
    got = causal_attention_ranges(q, k, v, runs, window, d ** -0.5)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_one_mask_made_for_the_runs_serves_every_call_and_is_row_aligned():
    """The fused pass makes the runs' mask once per request (from the positions already on
    the device) and hands it to every full layer: the same output as the call that makes
    its own, rows 16-element aligned, 0 exactly where a query may see a key."""
    runs = [(0, 3), (9, 14), (30, 37)]
    g = torch.Generator().manual_seed(3)
    n, lk = 15, 37
    q, k, v = torch.randn(n, 4, 8, generator=g), torch.randn(lk, 2, 8, generator=g), torch.randn(lk, 2, 8, generator=g)
    pos = torch.cat([torch.arange(a, b) for a, b in runs])
    mask = ranges_mask(runs, lk, q.dtype, q.device, q_pos=pos)
    assert mask.shape == (n, lk) and mask.stride(0) % 16 == 0
    assert torch.equal(mask == 0, torch.arange(lk)[None, :] <= pos[:, None])
    own = causal_attention_ranges(q, k, v, runs, None, 0.3)
    assert torch.equal(causal_attention_ranges(q, k, v, runs, None, 0.3, mask), own)
    with pytest.raises(ValueError, match=r"mask \(15, 36\) is not \[queries, keys\]"):
        causal_attention_ranges(q, k, v, runs, None, 0.3, mask[:, :36])


def test_runs_whose_mask_would_be_large_attend_run_by_run(monkeypatch):
    """Past RANGES_MASK_MAX (queries x keys) the runs take a call each (no mask in memory),
    with the same numbers; one run never takes the masked call."""
    runs = [(0, 3), (9, 14), (30, 37)]
    assert one_masked_call(runs, 37) and not one_masked_call([(0, 37)], 37)
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(15, 4, 8, generator=g), torch.randn(37, 2, 8, generator=g), torch.randn(37, 2, 8, generator=g)
    masked = causal_attention_ranges(q, k, v, runs, None, 0.3)
    monkeypatch.setattr(attention, "RANGES_MASK_MAX", 15 * 37 - 1)
    assert not one_masked_call(runs, 37)
    torch.testing.assert_close(causal_attention_ranges(q, k, v, runs, None, 0.3), masked, rtol=1e-5, atol=1e-6)


def test_ranges_must_cover_the_queries():
    q, k = torch.zeros(5, 2, 4), torch.zeros(9, 2, 4)
    with pytest.raises(ValueError, match="cover 3 queries"):
        causal_attention_ranges(q, k, k, [(0, 3)], None, 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 4])
def test_known_key_positions_with_gaps_attend_as_causal_attention_does(window, device):
    """causal_attention_known (the fused pass's sliding-window layers): keys at host-known
    positions with gaps, queries in runs, as causal_attention over the same positions."""
    g = torch.Generator().manual_seed(11 if window else 12)
    k_pos = [0, 1, 2, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 20, 21, 22]
    runs = [(6, 9), (13, 15), (20, 23)]
    h, hkv, d = 4, 2, 8
    n = sum(b - a for a, b in runs)
    q = torch.randn(n, h, d, generator=g)
    k, v = torch.randn(len(k_pos), hkv, d, generator=g), torch.randn(len(k_pos), hkv, d, generator=g)
    pos = torch.cat([torch.arange(a, b) for a, b in runs])
    want = causal_attention(q[None], k[None], v[None], pos, torch.tensor(k_pos), window, d ** -0.5)[0]
    got = causal_attention_known(q.to(device), k.to(device), v.to(device), runs, k_pos, window, d ** -0.5)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
