"""Tests of kernels.causal_conv: the Triton kernel against its torch reference on fresh random
inputs (strided x, tails, bias or not, SiLU or not, T shorter than the tail), and ShortConv's
prefill equal to feeding the same tokens one step at a time."""
import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.causal_conv import causal_conv1d, causal_conv1d_reference
from kernels.errors import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")


def _gen():
    return torch.Generator().manual_seed(int(torch.seed() % (2**31)))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,t,c,w,bias,silu,strided", [
    (1, 70, 130, 4, False, True, False),   # tiles cut in time and channels
    (2, 3, 24, 4, True, False, False),     # T shorter than the tail
    (3, 17, 40, 2, True, True, True),      # x a strided view (a slice of a wider projection)
])
def test_kernel_matches_reference(dtype, b, t, c, w, bias, silu, strided):
    gen = _gen()
    wide = torch.randn(b, t, c + (16 if strided else 0), generator=gen).to(DEVICE, dtype)
    x = wide[..., 8:8 + c] if strided else wide
    weight = torch.randn(c, w, generator=gen).to(DEVICE, dtype)
    bvec = torch.randn(c, generator=gen).to(DEVICE, dtype) if bias else None
    tail = torch.randn(b, c, w - 1, generator=gen).to(DEVICE, dtype)
    got = causal_conv1d(x, weight, bvec, tail, silu, force_triton=True)
    want = causal_conv1d_reference(x.float(), weight.float(), None if bvec is None else bvec.float(),
                                   tail.float(), silu)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.shape == (b, t, c) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_bad_shapes_are_refused_with_the_name():
    x = torch.zeros(1, 5, 8)
    with pytest.raises(KernelInputError, match="tail"):
        causal_conv1d(x, torch.zeros(8, 4), None, torch.zeros(1, 8, 2), True, force_triton=False)
    with pytest.raises(KernelInputError, match="weight"):
        causal_conv1d(x, torch.zeros(7, 4), None, torch.zeros(1, 8, 3), True, force_triton=False)


@needs_triton
def test_short_conv_prefill_through_the_kernel_equals_stepwise():
    """ShortConv.forward with the kernel forced (as on CUDA) equals feeding its tokens one
    step at a time from the same tail: outputs and the new tail."""
    from engine.models.layers.conv import ShortConv

    gen = _gen()
    conv = ShortConv(24, 4, bias=True).to(DEVICE)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(24, 4, generator=gen))
        conv.bias.copy_(torch.randn(24, generator=gen))
    x = torch.randn(2, 9, 24, generator=gen).to(DEVICE)
    tail0 = torch.randn(2, 24, 3, generator=gen).to(DEVICE)
    with torch.no_grad():
        y, tail = conv.forward(x, tail0, force_kernel=True)
        t, steps = tail0, []
        for i in range(x.shape[1]):
            yi, t = conv.step(x[:, i], t)
            steps.append(yi)
    torch.testing.assert_close(y, torch.stack(steps, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, t)
