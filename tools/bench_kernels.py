"""GPU benchmark of the Triton kernels in `kernels/` against their torch references.

For every case it times the public entry point with `force_triton=True` and with
`force_triton=False` (the torch reference on the same GPU), checks that both give the same
answer, and prints one table row: time per call, effective bandwidth (bytes the kernel must
move at minimum / time), speed-up, and the largest absolute difference between the two.
Times are medians over repeated CUDA-event-timed batches after a warm-up (which also runs
any autotuning). Nothing is printed that was not measured in this run.

Run on a CUDA machine from the repository root:
    PYTHONPATH=. python tools/bench_kernels.py                 # all kernels, bfloat16
    PYTHONPATH=. python tools/bench_kernels.py --only paged_decode_attention --dtype fp16
    PYTHONPATH=. python tools/bench_kernels.py --quick         # smaller cases, fewer repeats
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class BenchCase:
    """One benchmark case: two zero-argument callables returning comparable outputs, and the
    minimum number of bytes one call must move."""
    kernel: str
    name: str
    run_triton: Callable[[], torch.Tensor]
    run_torch: Callable[[], torch.Tensor]
    bytes_moved: int


@dataclass(frozen=True)
class BenchRow:
    kernel: str
    name: str
    triton_ms: float
    torch_ms: float
    bytes_moved: int
    max_abs_diff: float


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, inner: int) -> float:
    """Median over `repeats` batches of `inner` calls, in milliseconds per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) / inner)
    return statistics.median(samples)


# --------------------------------------------------------------------------- cases
def rope_scatter_cases(dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    from kernels.rope_scatter import rope_inv_freq, rope_scatter

    cases = []
    n = 4096 if quick else 32768
    for heads, head_dim, rotary_dim, block_size in ((8, 128, 128, 16), (8, 128, 64, 16), (4, 256, 64, 64)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(n, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(n, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        num_blocks = 2 * n // block_size
        blocks = torch.randperm(num_blocks, device="cuda", generator=gen)[: n // block_size]
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()
        pools = {which: [torch.zeros(num_blocks, block_size, heads, head_dim, device="cuda", dtype=dtype)
                         for _ in range(2)] for which in ("triton", "torch")}
        inv_freq = rope_inv_freq(rotary_dim, 1e6, device="cuda")

        def run(which, force, pools=pools, k=k, v=v, slots=slots, inv_freq=inv_freq, rotary_dim=rotary_dim):
            kp, vp = pools[which]
            rope_scatter(k, v, kp, vp, slots, 100000, rotary_dim=rotary_dim, inv_freq=inv_freq,
                         check_slots=False, force_triton=force)
            return kp

        elem = torch.tensor([], dtype=dtype).element_size()
        moved = 4 * n * heads * head_dim * elem + slots.numel() * 8
        cases.append(BenchCase("rope_scatter", f"n={n} Hkv={heads} D={head_dim} rot={rotary_dim}",
                               lambda run=run: run("triton", True), lambda run=run: run("torch", False), moved))
    return cases


def state_compose_cases(dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    from kernels.state_compose import state_compose

    del dtype  # states are float32 by contract
    cases = []
    B, H, dk, dv = (4, 16, 128, 128) if quick else (16, 32, 128, 128)
    for kind, m in (("scalar", 8), ("diagonal", 8), ("dense", 8), ("none", 8), ("dense", 2)):
        gen = torch.Generator(device="cuda").manual_seed(1)
        E = torch.randn(m, B, H, dk, dv, device="cuda", generator=gen)
        S0 = torch.randn(B, H, dk, dv, device="cuda", generator=gen)
        T = {"scalar": lambda: -torch.rand(m, B, H, device="cuda", generator=gen),
             "diagonal": lambda: -torch.rand(m, B, H, dk, device="cuda", generator=gen),
             "dense": lambda: torch.randn(m, B, H, dk, dk, device="cuda", generator=gen) / dk ** 0.5,
             "none": lambda: None}[kind]()
        moved = (E.numel() + 2 * S0.numel() + (T.numel() if T is not None else 0)) * 4
        cases.append(BenchCase(
            "state_compose", f"{kind} m={m} B={B} H={H} dk={dk} dv={dv}",
            lambda E=E, T=T, S0=S0: state_compose(E, T, S0, force_triton=True),
            lambda E=E, T=T, S0=S0: state_compose(E, T, S0, force_triton=False), moved))
    return cases


def paged_decode_attention_cases(dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    from kernels.paged_decode_attention import paged_decode_attention

    cases = []
    shapes = [  # (batch, q heads, kv heads, head_dim, mean length, block_size, window)
        (64, 32, 8, 128, 4096, 16, None),
        (64, 32, 8, 128, 4096, 16, 1024),
        (4, 32, 8, 128, 32768, 16, None),
        (128, 16, 16, 128, 2048, 16, None),
    ]
    if quick:
        shapes = [(b, hq, hk, d, max(256, L // 8), bs, w) for b, hq, hk, d, L, bs, w in shapes]
    for B, num_heads, num_kv_heads, head_dim, mean_len, block_size, window in shapes:
        gen = torch.Generator(device="cuda").manual_seed(2)
        lens = torch.randint(mean_len // 2, 3 * mean_len // 2, (B,), device="cuda", generator=gen)
        max_blocks = int(lens.max()) // block_size + 1
        num_blocks = B * max_blocks
        k_pages = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda",
                              dtype=dtype, generator=gen)
        v_pages = torch.randn_like(k_pages)
        tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(B, max_blocks).to(torch.int32)
        q = torch.randn(B, num_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        attended = lens.clamp(max=window) if window else lens
        elem = k_pages.element_size()
        moved = int(attended.sum()) * num_kv_heads * head_dim * 2 * elem + 2 * q.numel() * elem
        lens32 = lens.to(torch.int32)

        def run(force, q=q, k_pages=k_pages, v_pages=v_pages, tables=tables, lens32=lens32, window=window):
            return paged_decode_attention(q, k_pages, v_pages, tables, lens32, window=window, force_triton=force)

        cases.append(BenchCase(
            "paged_decode_attention",
            f"B={B} Hq={num_heads} Hkv={num_kv_heads} D={head_dim} L~{mean_len} win={window}",
            lambda run=run: run(True), lambda run=run: run(False), moved))
    return cases


CASES = {
    "rope_scatter": rope_scatter_cases,
    "state_compose": state_compose_cases,
    "paged_decode_attention": paged_decode_attention_cases,
}


def run_case(case: BenchCase, warmup: int, repeats: int, inner: int) -> BenchRow:
    got = case.run_triton().float()
    want = case.run_torch().float()
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    return BenchRow(case.kernel, case.name,
                    time_ms(case.run_triton, warmup, repeats, inner),
                    time_ms(case.run_torch, warmup, repeats, inner),
                    case.bytes_moved, diff)


def format_table(rows: list[BenchRow]) -> str:
    header = ("kernel", "case", "triton ms", "triton GB/s", "torch ms", "torch GB/s", "speed-up", "max|diff|")
    lines = [header]
    for r in rows:
        lines.append((r.kernel, r.name, f"{r.triton_ms:.4f}", f"{r.bytes_moved / r.triton_ms / 1e6:.0f}",
                      f"{r.torch_ms:.4f}", f"{r.bytes_moved / r.torch_ms / 1e6:.0f}",
                      f"{r.torch_ms / r.triton_ms:.1f}x", f"{r.max_abs_diff:.2e}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="KV / activation dtype")
    parser.add_argument("--quick", action="store_true", help="smaller cases and fewer repeats")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; this benchmark times GPU kernels only", file=sys.stderr)
        return 2
    unknown = [k for k in args.only.split(",") if k not in CASES]
    if unknown:
        parser.error(f"unknown kernel(s) {unknown}; choose from {list(CASES)}")
    warmup, repeats, inner = (3, 5, 5) if args.quick else (10, 15, 10)
    import triton

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"dtype {args.dtype}")
    rows = []
    for kernel in args.only.split(","):
        for case in CASES[kernel](DTYPES[args.dtype], args.quick):
            rows.append(run_case(case, warmup, repeats, inner))
            print(f"  done: {case.kernel} {case.name}", file=sys.stderr, flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
