"""GPU check of kernels.seam_chain at the bench presets' linear shapes: the Triton kernel
against its torch reference (fp32 and bf16 inputs) on random event chains (seams of
`--seam` tokens between spliced pieces, a suffix), and the kernel's time per call against
the per-event path it replaces (fla fused_recurrent per range + torch composition).

After that table, a launch-shape table (bf16 inputs; `--no-variants` skips it): per preset
the default `ChainLaunch`, the same with and without the token prefetch, for diag two
shapes that spill less, and for the delta rule the first version (whole T in registers, no
prefetch: `old`) and a small grid of compose chunk x block_v x num_warps; each with its
error against the reference, its time and the per-event baseline; the fastest launch is
named per preset.

    python3 tools/check_seam_chain.py [--pieces 10 --seam 16 --suffix 32] [--no-variants]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine.models.layers.fla_backend import fla_importable, fla_recurrent
from engine.models.layers.linear_ops import RecurrenceInputs
from kernels.seam_chain import COMPOSE, COMPUTE, SET, ChainEvents, ChainLaunch, seam_chain, seam_chain_reference

SHAPES = {  # preset: (family, H, dk, dv)
    "qwen3next-bench": ("delta", 32, 128, 128), "gla-bench": ("diag", 16, 64, 128),
    "ring-bench": ("scalar", 16, 128, 128), "nemotronh-bench": ("scalar", 64, 128, 64)}


def build(family, H, dk, dv, pieces, seam, suffix, dtype, dev, gen):
    table, rows, E, T, off, nt = [(SET, 0, 0)], [[-1] * H], [torch.randn(H, dk, dv, generator=gen)], [], 0, 0
    for j in range(pieces):
        table.append((COMPUTE, off, off + seam)); rows.append([-1] * H); off += seam
        table.append((COMPOSE, len(E), 0)); E.append(torch.randn(H, dk, dv, generator=gen))
        rows.append(list(range(nt, nt + H))); nt += H
        if family == "delta":
            T.append(torch.randn(H, dk, dk, generator=gen) / dk ** 0.5)
        else:
            T.append(-torch.rand(H, dk, generator=gen) if family == "diag" else -torch.rand(H, generator=gen))
    table.append((COMPUTE, off, off + suffix)); rows.append([-1] * H); off += suffix
    t = off
    nrm = torch.nn.functional.normalize
    inp = RecurrenceInputs(nrm(torch.randn(1, t, H, dk, generator=gen), dim=-1).to(dev, dtype),
                           nrm(torch.randn(1, t, H, dk, generator=gen), dim=-1).to(dev, dtype),
                           torch.randn(1, t, H, dv, generator=gen).to(dev, dtype),
                           (-torch.rand(1, t, H, *((dk,) if family == "diag" else ()), generator=gen) * 0.1).to(dev),
                           torch.sigmoid(torch.randn(1, t, H, generator=gen)).to(dev, dtype) if family == "delta" else None,
                           dk ** -0.5)
    ev = ChainEvents(torch.tensor(table, dtype=torch.int32, device=dev), torch.tensor(rows, dtype=torch.int32, device=dev),
                     torch.stack(E).to(dev), torch.cat(T).to(dev))
    return inp, ev


def per_event(family, inp, S, ev):
    for kind, a, b in ev.table.tolist():
        if kind == COMPUTE:
            S = fla_recurrent(family, inp.slice_time(a, b), S[None])[1][0]
        elif kind == SET:
            S = ev.E[a].clone()
        else:
            j = a - 1  # compose of piece j: E row j + 1, T rows [j H, (j + 1) H)
            H = S.shape[0]
            Tj = ev.T[j * H:(j + 1) * H]
            S = torch.baddbmm(ev.E[a], Tj, S) if family == "delta" else (
                torch.exp(Tj)[..., None] if family == "diag" else torch.exp(Tj)[:, None, None]) * S + ev.E[a]
    return S


def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def variants(family):
    """(label, ChainLaunch) pairs to time for this family: default first."""
    out = [("default", ChainLaunch()), ("prefetch", ChainLaunch(prefetch=True)),
           ("no-prefetch", ChainLaunch(prefetch=False))]
    if family == "diag":  # ptxas: the default shape spills (tools/ptxas_seam_chain.py); these do less
        out += [("bv=32,warps=4", ChainLaunch(32, 4)), ("bv=64,warps=8", ChainLaunch(64, 8))]
    if family == "delta":
        out.append(("old(whole-T,no-prefetch)", ChainLaunch(compose_chunk=0, prefetch=False)))
        out.append(("whole-T,prefetch", ChainLaunch(compose_chunk=0)))
        for chunk in (16, 32):
            for bv, nw in ((32, 8), (32, 4), (16, 4), (16, 2), (64, 8)):
                out.append((f"chunk={chunk},bv={bv},warps={nw}", ChainLaunch(bv, nw, chunk)))
    return out


def launch_table(a, dev, dtype=torch.bfloat16):
    print(f"\n# launch shapes ({dtype} inputs; pieces={a.pieces} seam={a.seam} suffix={a.suffix})")
    for name, (family, H, dk, dv) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        inp, ev = build(family, H, dk, dv, a.pieces, a.seam, a.suffix, dtype, dev, gen)
        S0 = torch.zeros(H, dk, dv, device=dev)
        o_ref, s_ref = seam_chain_reference(inp, S0, ev, family)
        base = timed(lambda: per_event(family, inp, S0, ev)) if fla_importable() else float("nan")
        best = None
        for label, launch in variants(family):
            o, s = seam_chain(inp, S0, ev, family, force_triton=True, launch=launch)
            err_o = (o.float() - o_ref.float()).abs().max().item()
            err_s = ((s - s_ref).abs().max() / s_ref.abs().max().clamp_min(1e-6)).item()
            ms = timed(lambda: seam_chain(inp, S0, ev, family, force_triton=True, launch=launch))
            bk, bv, nw, pf = launch.resolve(family, dk, dv)
            print(f"{name:16s} {family:6s} {label:28s} (BLOCK_K={bk} BLOCK_V={bv} warps={nw} prefetch={int(pf)}) "
                  f"max|o-ref|={err_o:.2e} rel|S-ref|={err_s:.2e} chain={ms:.3f} ms/call "
                  f"per-event(fla+torch)={base:.3f} ms/call")
            if best is None or ms < best[1]:
                best = (label, ms)
        print(f"{name:16s} {family:6s} fastest: {best[0]} {best[1]:.3f} ms/call")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pieces", type=int, default=10)
    ap.add_argument("--seam", type=int, default=16)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--no-variants", action="store_true", help="skip the launch-shape table")
    a = ap.parse_args()
    dev = "cuda"
    for name, (family, H, dk, dv) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            inp, ev = build(family, H, dk, dv, a.pieces, a.seam, a.suffix, dtype, dev, gen)
            S0 = torch.zeros(H, dk, dv, device=dev)
            o_ref, s_ref = seam_chain_reference(inp, S0, ev, family)
            o, s = seam_chain(inp, S0, ev, family, force_triton=True)
            err_o = (o.float() - o_ref.float()).abs().max().item()
            err_s = ((s - s_ref).abs().max() / s_ref.abs().max().clamp_min(1e-6)).item()
            ms = timed(lambda: seam_chain(inp, S0, ev, family, force_triton=True))
            base = timed(lambda: per_event(family, inp, S0, ev)) if fla_importable() else float("nan")
            print(f"{name:16s} {family:6s} {str(dtype):15s} max|o-ref|={err_o:.2e} rel|S-ref|={err_s:.2e} "
                  f"chain={ms:.3f} ms/call per-event(fla+torch)={base:.3f} ms/call")
    if not a.no_variants:
        launch_table(a, dev)


if __name__ == "__main__":
    main()
