"""Tests of kernels.fused_norms: the Triton kernels against their torch references and against
the norm modules' own CPU forms (GatedRMSNorm, GroupRMSNormGate, l2_normalize), on fresh
random inputs."""
import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.fused_norms import (
    gated_rms_norm_rows,
    gated_rms_norm_rows_reference,
    l2_normalize_rows,
    l2_normalize_rows_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")


def _gen():
    return torch.Generator().manual_seed(int(torch.seed() % (2**31)))


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-3


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 4, 24), (130, 128), (1, 7, 2, 40)])
def test_l2_kernel_matches_reference_and_module(dtype, shape):
    from engine.models.layers.norm import l2_normalize

    gen = _gen()
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    got = l2_normalize_rows(x, 1e-6, force_triton=True)
    torch.testing.assert_close(got.float(), l2_normalize_rows_reference(x.float(), 1e-6), rtol=_tol(dtype),
                               atol=_tol(dtype))
    torch.testing.assert_close(got.float(), l2_normalize(x.float().cpu(), 1e-6).to(DEVICE), rtol=_tol(dtype),
                               atol=_tol(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_kernel_matches_the_gated_rmsnorm_module(dtype, activation):
    from engine.models.layers.norm import GatedRMSNorm

    gen = _gen()
    mod = GatedRMSNorm(40, eps=1e-6, activation=activation)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(40, generator=gen))
    x = torch.randn(2, 9, 3, 40, generator=gen)
    gate = torch.randn(2, 9, 3, 40, generator=gen)
    want = mod(x, gate)  # the CPU torch form
    got = gated_rms_norm_rows(x.to(DEVICE, dtype), gate.to(DEVICE, dtype), mod.weight.to(DEVICE), 1e-6, activation,
                              40, force_triton=True)
    torch.testing.assert_close(got.float().cpu(), want, rtol=_tol(dtype), atol=_tol(dtype))
    ref = gated_rms_norm_rows_reference(x, gate, mod.weight, 1e-6, activation, 40)
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)


@needs_triton
def test_group_kernel_matches_the_group_norm_gate_module():
    """Ring's g_norm: groups of a token's channels, the weight spanning every group."""
    from engine.models.layers.norm import GroupRMSNormGate

    gen = _gen()
    mod = GroupRMSNormGate(96, groups=4, eps=1e-5)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(96, generator=gen))
    x = torch.randn(5, 7, 96, generator=gen)
    gate = torch.randn(5, 7, 96, generator=gen)
    want = mod(x, gate)
    got = gated_rms_norm_rows(x.to(DEVICE), gate.to(DEVICE), mod.weight.to(DEVICE), 1e-5, "sigmoid", 24,
                              force_triton=True)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name():
    x = torch.zeros(2, 8)
    with pytest.raises(KernelInputError, match="gate"):
        gated_rms_norm_rows(x, torch.zeros(2, 4), torch.ones(8), 1e-6, "silu", 8, force_triton=False)
    with pytest.raises(KernelInputError, match="activation"):
        gated_rms_norm_rows(x, x, torch.ones(8), 1e-6, "relu", 8, force_triton=False)
    with pytest.raises(KernelInputError, match="weight"):
        gated_rms_norm_rows(x, x, torch.ones(3), 1e-6, "silu", 8, force_triton=False)
