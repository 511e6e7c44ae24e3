"""Tests of kernels.rope_scatter: the Triton kernel against its torch reference, and
re-rotated keys against keys computed directly at their true positions."""
import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.rope_scatter import (
    apply_rope_reference,
    ring_slot_mapping,
    rope_delta_cos_sin,
    rope_inv_freq,
    rope_scatter,
    rope_scatter_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")


def _pools(num_blocks, block_size, heads, head_dim, dtype, gen):
    shape = (num_blocks, block_size, heads, head_dim)
    k_pages = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)
    v_pages = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)
    return k_pages, v_pages


def _random_slots(n, num_blocks, block_size, gen, skip_every=0):
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    if skip_every:
        slots[::skip_every] = -1
    return slots.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32),
                                              (torch.float16, torch.float16),
                                              (torch.float32, torch.float16)])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("angle_precision", ["fp64", "fp32"])
def test_triton_matches_reference_on_random_inputs(dtype, pool_dtype, rotary_dim, angle_precision):
    gen = torch.Generator().manual_seed(1000 + rotary_dim)
    n, heads, head_dim, num_blocks, block_size = 37, 3, 32, 12, 8
    k = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = _random_slots(n, num_blocks, block_size, gen, skip_every=5)
    k_ref, v_ref = _pools(num_blocks, block_size, heads, head_dim, pool_dtype, gen)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    args = dict(rotary_dim=rotary_dim, theta=500000.0, angle_precision=angle_precision)
    rope_scatter_reference(k, v, k_ref, v_ref, slots, 4321, **args)
    rope_scatter(k, v, k_tri, v_tri, slots, 4321, force_triton=True, **args)
    tol = 1e-6 if pool_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(k_tri, k_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(v_tri, v_ref, rtol=0, atol=0)


@needs_triton
def test_triton_per_token_offsets_and_strided_inputs_match_reference():
    gen = torch.Generator().manual_seed(7)
    n, heads, head_dim = 20, 2, 24
    full = torch.randn(n, heads, 2 * head_dim, generator=gen).to(DEVICE)
    k, v = full[..., :head_dim], full[..., head_dim:]  # non-contiguous views
    offsets = torch.randint(0, 50000, (n,), generator=gen).to(DEVICE)
    slots = _random_slots(n, 8, 4, gen)
    k_ref, v_ref = _pools(8, 4, heads, head_dim, torch.float32, gen)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    rope_scatter_reference(k, v, k_ref, v_ref, slots, offsets, rotary_dim=16)
    rope_scatter(k, v, k_tri, v_tri, slots, offsets, rotary_dim=16, force_triton=True)
    torch.testing.assert_close(k_tri, k_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_tri, v_ref, rtol=0, atol=0)


def _splice_case(offset, rotary_dim, head_dim=64, n=48, heads=2, theta=10000.0):
    gen = torch.Generator().manual_seed(offset % 9973 + rotary_dim)
    raw = torch.randn(n, heads, head_dim, generator=gen)
    inv_freq = rope_inv_freq(rotary_dim, theta)
    base = apply_rope_reference(raw, torch.arange(n), rotary_dim, inv_freq)  # cached at 0..n-1
    true_pos = torch.arange(offset, offset + n)
    exact = apply_rope_reference(raw, true_pos, rotary_dim, inv_freq, compute_dtype=torch.float64)
    model = apply_rope_reference(raw, true_pos, rotary_dim, inv_freq)  # model's own fp32 RoPE
    return raw, base, exact, model, inv_freq


def _splice(base, offset, rotary_dim, inv_freq, angle_precision, force_triton):
    n, heads, head_dim = base.shape
    block_size = 16
    k_pages = torch.zeros(n // block_size + 2, block_size, heads, head_dim, device=DEVICE)
    v_pages = torch.zeros_like(k_pages)
    slots = torch.arange(n, device=DEVICE) + block_size  # contiguous run starting at block 1
    rope_scatter(base.to(DEVICE), base.to(DEVICE), k_pages, v_pages, slots, offset,
                 rotary_dim=rotary_dim, inv_freq=inv_freq, angle_precision=angle_precision,
                 force_triton=force_triton)
    return k_pages.flatten(0, 1)[block_size:block_size + n].cpu().double()


@pytest.mark.parametrize("force_triton", [
    pytest.param(True, marks=needs_triton, id="triton"), pytest.param(False, id="reference")])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("offset", [1000, 100000])
def test_rerotated_keys_equal_keys_rotated_at_true_positions(force_triton, rotary_dim, offset):
    raw, base, exact, model, inv_freq = _splice_case(offset, rotary_dim)
    spliced = _splice(base, offset, rotary_dim, inv_freq, "fp64", force_triton)
    # fp64 angles: error is the float32 rounding of the base rotation and of the product only.
    torch.testing.assert_close(spliced, exact, rtol=0, atol=2e-5)
    # Pass-through dims are copied bit for bit.
    torch.testing.assert_close(spliced[..., rotary_dim:], raw[..., rotary_dim:].double(), rtol=0, atol=0)
    # Against the model's own float32 RoPE at the true position: that one is off by up to half a
    # float32 ulp of the largest angle (pairs have |x| <= max pair norm), so bound by one ulp.
    max_angle = float((offset + raw.shape[0]) * inv_freq.max())
    ulp = torch.finfo(torch.float32).eps * 2.0 ** torch.tensor(max_angle).log2().floor().item()
    pair_norm = (raw[..., :rotary_dim // 2] ** 2 + raw[..., rotary_dim // 2:rotary_dim] ** 2).sqrt().max()
    torch.testing.assert_close(spliced, model.double(), rtol=0, atol=float(pair_norm * ulp) + 2e-5)


@pytest.mark.parametrize("force_triton", [
    pytest.param(True, marks=needs_triton, id="triton"), pytest.param(False, id="reference")])
def test_fp64_angles_beat_fp32_angles_at_large_offset(force_triton):
    offset, rotary_dim = 100000, 64
    raw, base, exact, model, inv_freq = _splice_case(offset, rotary_dim)
    err64 = (_splice(base, offset, rotary_dim, inv_freq, "fp64", force_triton) - exact).abs().max()
    err32 = (_splice(base, offset, rotary_dim, inv_freq, "fp32", force_triton) - exact).abs().max()
    err_model = (model.double() - exact).abs().max()
    assert err64 < 2e-5
    assert err32 > 50 * err64, (err32, err64)  # fp32 angle rounding at 1e5 is ~1e-3 rad
    assert err_model > 50 * err64, (err_model, err64)


@pytest.mark.parametrize("force_triton", [
    pytest.param(True, marks=needs_triton, id="triton"), pytest.param(False, id="reference")])
def test_ring_slot_mapping_writes_last_window_positions_at_p_mod_window(force_triton):
    gen = torch.Generator().manual_seed(3)
    window, num_slots, heads, head_dim, n, offset, ring = 8, 3, 2, 16, 13, 21, 1
    k = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE)
    k_ring = torch.zeros(num_slots, window, heads, head_dim, device=DEVICE)
    v_ring = torch.zeros_like(k_ring)
    positions = torch.arange(offset, offset + n)
    slots = ring_slot_mapping(ring, positions, window).to(DEVICE)
    assert (slots >= 0).sum() == window
    rope_scatter(k, v, k_ring, v_ring, slots, offset, rotary_dim=head_dim, force_triton=force_triton)
    inv_freq = rope_inv_freq(head_dim)
    for t in range(n - window, n):
        p = offset + t
        want_k = apply_rope_reference(k.cpu()[t:t + 1].double(), torch.tensor([offset]), head_dim,
                                      inv_freq, compute_dtype=torch.float64)[0]
        torch.testing.assert_close(k_ring[ring, p % window].cpu().double(), want_k, rtol=0, atol=1e-5)
        torch.testing.assert_close(v_ring[ring, p % window], v[t], rtol=0, atol=0)
    assert k_ring[0].abs().sum() == 0 and k_ring[2].abs().sum() == 0  # other rings untouched


def test_bad_inputs_raise_naming_the_argument():
    k = torch.zeros(4, 2, 8)
    pages = torch.zeros(2, 4, 2, 8)
    slots = torch.arange(4)
    with pytest.raises(KernelInputError, match="rotary_dim"):
        rope_scatter(k, k, pages, pages.clone(), slots, 0, rotary_dim=7)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        rope_scatter(k, k, pages, pages.clone(), torch.tensor([0, 1, 2, 8]), 0)
    with pytest.raises(KernelInputError, match="pages hold"):
        rope_scatter(k, k, torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), slots, 0)
    with pytest.raises(KernelInputError, match="offset"):
        rope_scatter(k, k, pages, pages.clone(), slots, 1.5)


@pytest.mark.parametrize("force_triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("per_token", [False, True])
def test_cos_sin_made_once_by_the_caller_write_what_the_call_makes_itself(per_token, force_triton):
    """The fused prefill makes rope_delta_cos_sin once per request and passes it to every
    full layer's call: the same pages as a call that makes its own; a mismatched shape is
    rejected."""
    gen = torch.Generator().manual_seed(23)
    n, heads, head_dim, num_blocks, block_size = 19, 2, 16, 6, 8
    k = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE)
    slots = _random_slots(n, num_blocks, block_size, gen)
    offset = torch.randint(-50, 900, (n,), generator=gen).to(DEVICE) if per_token else 777
    inv = rope_inv_freq(16, 10000.0, device=DEVICE)
    own_k, own_v = _pools(num_blocks, block_size, heads, head_dim, torch.float32, gen)
    given_k, given_v = own_k.clone(), own_v.clone()
    rope_scatter(k, v, own_k, own_v, slots, offset, inv_freq=inv, force_triton=force_triton)
    cs = rope_delta_cos_sin(offset, inv)
    rope_scatter(k, v, given_k, given_v, slots, offset, inv_freq=inv, force_triton=force_triton, cos_sin=cs)
    assert torch.equal(given_k, own_k) and torch.equal(given_v, own_v)
    with pytest.raises(KernelInputError, match="cos_sin must be two"):
        rope_scatter(k, v, given_k, given_v, slots, offset, inv_freq=inv, cos_sin=(cs[0][:, :4], cs[1][:, :4]))
