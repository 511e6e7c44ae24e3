"""Tests of kernels.seam_chain: the Triton kernel against its torch reference on fresh
random event chains (every family; computed ranges, set, naive add, compose with live and
forgotten heads), and the reference against a plain walk of the events with
linear_ops' recurrence and explicit compositions."""
from __future__ import annotations

import pytest
import torch

from engine.models.layers.linear_ops import RecurrenceInputs, chunked_recurrence
from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.seam_chain import (ADD, COMPOSE, COMPUTE, SET, ChainEvents, ChainLaunch, seam_chain,
                               seam_chain_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")

H, DK, DV = 2, 16, 16
# (kind, tokens or None): a first placement, seams and pieces, an add, a suffix
CHAIN = [(SET, None), (COMPUTE, 3), (COMPOSE, None), (COMPUTE, 1), (COMPOSE, None), (ADD, None),
         (COMPUTE, 5), (COMPOSE, None), (COMPUTE, 2)]


def _inputs(family, t, gen, dk=DK, dv=DV):
    q = torch.nn.functional.normalize(torch.randn(1, t, H, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, t, H, dk, generator=gen), dim=-1)
    v = torch.randn(1, t, H, dv, generator=gen)
    g = -torch.rand(1, t, H, dk, generator=gen) if family == "diag" else -torch.rand(1, t, H, generator=gen)
    beta = torch.sigmoid(torch.randn(1, t, H, generator=gen)) if family == "delta" else None
    return RecurrenceInputs(q, k, v, g, beta, scale=dk ** -0.5)


def _events(family, gen, chain=CHAIN, dk=DK, dv=DV):
    """Random E/T stacks for `chain`; in delta compositions head 1 of the second one forgot
    (row -1) and only live heads are stacked."""
    table, rows, E, T, off, n_t = [], [], [], [], 0, 0
    for j, (kind, n) in enumerate(chain):
        if kind == COMPUTE:
            table.append((COMPUTE, off, off + n))
            rows.append([-1] * H)
            off += n
            continue
        table.append((kind, len(E), 0))
        E.append(torch.randn(H, dk, dv, generator=gen))
        r = [-1] * H
        if kind == COMPOSE:
            live = [0] if (family == "delta" and len([c for c in table if c[0] == COMPOSE]) == 2) else list(range(H))
            for h in live:
                r[h] = n_t
                n_t += 1
                if family == "delta":
                    T.append(torch.randn(dk, dk, generator=gen) / dk ** 0.5)
                elif family == "diag":
                    T.append(-2 * torch.rand(dk, generator=gen))
                else:
                    T.append(-2 * torch.rand((), generator=gen))
        rows.append(r)
    ev = ChainEvents(torch.tensor(table, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32),
                     torch.stack(E), torch.stack(T) if T else None)
    return ev, off


def _to(ev, inp, device):
    mv = lambda x: None if x is None else x.to(device)  # noqa: E731
    return (ChainEvents(ev.table.to(device), ev.t_row.to(device), ev.E.to(device), mv(ev.T)),
            RecurrenceInputs(mv(inp.q), mv(inp.k), mv(inp.v), mv(inp.log_decay), mv(inp.beta), inp.scale))


@needs_triton
@pytest.mark.parametrize("family", ["scalar", "diag", "delta"])
def test_triton_matches_reference_on_a_random_chain(family):
    gen = torch.Generator().manual_seed(7 + len(family))
    ev, t = _events(family, gen)
    inp = _inputs(family, t, gen)
    S0 = torch.randn(H, DK, DV, generator=gen)
    ev, inp = _to(ev, inp, DEVICE)
    o_ref, s_ref = seam_chain_reference(inp, S0.to(DEVICE), ev, family)
    o, s = seam_chain(inp, S0.to(DEVICE), ev, family, force_triton=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("family", ["delta", "diag"])
def test_triton_matches_reference_with_dims_that_are_not_powers_of_two(family):
    gen = torch.Generator().manual_seed(3)
    chain = [(COMPUTE, 2), (COMPOSE, None), (COMPUTE, 4)]
    ev, t = _events(family, gen, chain, dk=12, dv=20)
    inp = _inputs(family, t, gen, dk=12, dv=20)
    S0 = torch.randn(H, 12, 20, generator=gen)
    ev, inp = _to(ev, inp, DEVICE)
    o_ref, s_ref = seam_chain_reference(inp, S0.to(DEVICE), ev, family)
    o, s = seam_chain(inp, S0.to(DEVICE), ev, family, force_triton=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


# composes in a row (the scratch tile rewritten each time), a forgotten head, several dv
# blocks per head; dk not a multiple of the compose chunk
DELTA_RUN = [(COMPUTE, 3), (COMPOSE, None), (COMPOSE, None), (COMPOSE, None), (COMPUTE, 2), (COMPOSE, None),
             (COMPUTE, 1)]


@needs_triton
@pytest.mark.parametrize("dk,dv,launch", [
    (24, 40, ChainLaunch(block_v=16)),
    (40, 24, ChainLaunch(block_v=16, compose_chunk=32, num_warps=2)),
    (40, 24, ChainLaunch(compose_chunk=0, prefetch=False)),
], ids=["dk24-chunk16", "dk40-chunk32", "dk40-whole-T"])
def test_delta_compose_in_chunks_matches_reference_over_composes_in_a_row(dk, dv, launch):
    gen = torch.Generator().manual_seed(dk * 100 + dv + launch.compose_chunk)
    ev, t = _events("delta", gen, DELTA_RUN, dk=dk, dv=dv)
    inp = _inputs("delta", t, gen, dk=dk, dv=dv)
    S0 = torch.randn(H, dk, dv, generator=gen)
    ev, inp = _to(ev, inp, DEVICE)
    o_ref, s_ref = seam_chain_reference(inp, S0.to(DEVICE), ev, "delta")
    o, s = seam_chain(inp, S0.to(DEVICE), ev, "delta", force_triton=True, launch=launch)
    assert ev.t_row[2].tolist() == [ev.t_row[2, 0].item(), -1]  # head 1 forgot in the second compose
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("family", ["scalar", "diag", "delta"])
def test_triton_with_half_inputs_with_and_without_prefetch_matches_reference(family):
    gen = torch.Generator().manual_seed(11 + len(family))
    ev, t = _events(family, gen)
    inp = _inputs(family, t, gen)
    half = lambda x: None if x is None else x.half()  # noqa: E731
    inp = RecurrenceInputs(half(inp.q), half(inp.k), half(inp.v), inp.log_decay, half(inp.beta), inp.scale)
    ev = ChainEvents(ev.table, ev.t_row, ev.E.half(), ev.T.half() if family == "delta" else ev.T)
    S0 = torch.randn(H, DK, DV, generator=gen)
    ev, inp = _to(ev, inp, DEVICE)
    o_ref, s_ref = seam_chain_reference(inp, S0.to(DEVICE), ev, family)
    for launch in (ChainLaunch(prefetch=True), ChainLaunch(prefetch=False)):
        o, s = seam_chain(inp, S0.to(DEVICE), ev, family, force_triton=True, launch=launch)
        torch.testing.assert_close(o, o_ref, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,match", [({"block_v": 24}, "block_v"), ({"num_warps": 3}, "num_warps"),
                                      ({"compose_chunk": 8}, "compose_chunk")])
def test_chain_launch_rejects_a_bad_shape(kw, match):
    with pytest.raises(KernelInputError, match=match):
        ChainLaunch(**kw)


@pytest.mark.parametrize("family", ["scalar", "diag", "delta"])
def test_reference_equals_a_plain_walk_of_recurrences_and_compositions(family):
    gen = torch.Generator().manual_seed(21)
    ev, t = _events(family, gen)
    inp = _inputs(family, t, gen)
    S = torch.randn(H, DK, DV, generator=gen)
    o_ref, s_ref = seam_chain_reference(inp, S, ev, family)
    outs = []
    for i, (kind, a, b) in enumerate(ev.table.tolist()):
        if kind == COMPUTE:
            o, st = chunked_recurrence(family, inp.slice_time(a, b), S[None], chunk_size=2)
            S = st[0]
            outs.append(o)
        elif kind == SET:
            S = ev.E[a].clone()
        elif kind == ADD:
            S = S + ev.E[a]
        else:
            T = torch.zeros(H, DK, DK) if family == "delta" else None
            new = ev.E[a].clone()
            for h, r in enumerate(ev.t_row[i].tolist()):
                if r < 0:
                    continue
                if family == "delta":
                    new[h] += ev.T[r] @ S[h]
                elif family == "diag":
                    new[h] += ev.T[r].exp()[:, None] * S[h]
                else:
                    new[h] += ev.T[r].exp() * S[h]
            del T
            S = new
    torch.testing.assert_close(o_ref, torch.cat(outs, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_ref, S, rtol=1e-5, atol=1e-5)


def test_seam_chain_rejects_a_table_of_the_wrong_shape():
    gen = torch.Generator().manual_seed(1)
    ev, t = _events("scalar", gen)
    inp = _inputs("scalar", t, gen)
    bad = ChainEvents(ev.table[:, :2].contiguous(), ev.t_row, ev.E, ev.T)
    with pytest.raises(KernelInputError, match="table"):
        seam_chain(inp, torch.zeros(H, DK, DV), bad, "scalar")
    with pytest.raises(KernelInputError, match="S0"):
        seam_chain(inp, torch.zeros(H, DK, DV + 1), ev, "scalar")
