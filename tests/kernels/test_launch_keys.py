"""The Triton kernels a request reaches in varying shapes keep ONE specialisation key
across them (tools/servebench/kernel_keys.py computes the key Triton compiles per), so a
serving engine compiles them once at warm-up, not inside a request: the seam chain over
event-table slices at any row and over channel-first values (engine.pic.conv_ranges'
layout), the causal conv over any token count. Outputs are checked against the torch
references on the same fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.causal_conv import causal_conv1d, causal_conv1d_reference
from kernels.seam_chain import ChainEvents, seam_chain, seam_chain_reference
from tests.kernels.test_seam_chain import DK, DV, H, _events, _inputs, _to
from tools.servebench.kernel_keys import KernelLaunches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")


def _keys(launches: KernelLaunches, kernel: str) -> set[str]:
    return {key for (name, key) in launches.first_label if name == kernel}


def _channel_first(v: torch.Tensor) -> torch.Tensor:
    """v `[1, T, H, dv]` laid out as conv_ranges leaves it: a `[H*dv, T]` buffer transposed."""
    _, t, h, dv = v.shape
    buf = v[0].reshape(t, h * dv).t().contiguous()  # [C, T]
    return buf.t()[None].reshape(1, t, h, dv)


def test_seam_chain_keeps_one_key_over_table_slices_and_value_layouts():
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    ev, t = _events("delta", gen)
    inp = _inputs("delta", t, gen)
    S0 = torch.randn(H, DK, DV, generator=gen).to(DEVICE)
    ev, inp = _to(ev, inp, DEVICE)
    cf = _channel_first(inp.v)
    assert cf.stride(-1) != 1 and torch.equal(cf, inp.v)
    n = ev.table.shape[0]
    cases = [(0, n, inp), (1, n, inp), (3, n, inp), (1, n, type(inp)(inp.q, inp.k, cf, inp.log_decay, inp.beta,
                                                                       inp.scale))]
    launches = KernelLaunches()
    with launches.recording():
        for a, b, x in cases:
            sub = ChainEvents(ev.table[a:b], ev.t_row[a:b], ev.E, ev.T)
            o, s = seam_chain(x, S0, sub, "delta", force_triton=True)
            o_ref, s_ref = seam_chain_reference(inp, S0, sub, "delta")
            rows = [r for kind, lo, hi in sub.table.tolist() if kind == 0 for r in range(lo, hi)]
            torch.testing.assert_close(s, s_ref, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(o[:, rows], o_ref[:, rows], rtol=2e-4, atol=2e-4)
    assert ev.table[1:].data_ptr() % 16 != 0  # the slices did start off the 16-byte grid
    assert len(_keys(launches, "_seam_chain_kernel")) == 1


def test_causal_conv_keeps_one_key_over_token_counts():
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    c, w = 40, 4
    weight = torch.randn(c, w, generator=gen).to(DEVICE)
    launches = KernelLaunches()
    with launches.recording():
        for t in (1, 16, 17, 48):
            x = torch.randn(1, t, c, generator=gen).to(DEVICE)
            tail = torch.randn(1, c, w - 1, generator=gen).to(DEVICE)
            got = causal_conv1d(x, weight, None, tail, True, force_triton=True)
            torch.testing.assert_close(got, causal_conv1d_reference(x, weight, None, tail, True),
                                       rtol=1e-5, atol=1e-5)
    assert len(_keys(launches, "_causal_conv_kernel")) == 1
