"""Registers and spills of kernels.seam_chain's Triton kernel per launch shape, without a
GPU: compiles the kernel ahead of time for an NVIDIA target (default sm_90, the H200) and
runs the ptxas that ships with triton with -v. A spill-free kernel is a precondition for
speed here (one program per SM at the bench shapes: the token walk is latency bound), not
a timing; tools/check_seam_chain.py times the shapes on the GPU.

    python3 tools/ptxas_seam_chain.py [--arch 90] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.seam_chain import _FAMILY_CODE, ChainLaunch, _seam_chain_kernel

SHAPES = {  # preset: (family, dk, dv), as tools/check_seam_chain.py
    "qwen3next-bench": ("delta", 128, 128), "gla-bench": ("diag", 64, 128), "ring-bench": ("scalar", 128, 128)}
CONSTEXPRS = ("FAMILY", "BLOCK_K", "BLOCK_V", "COMPOSE_CHUNK", "PREFETCH")
INPUT_PTRS = ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "o_ptr")


def signature(dtype: str) -> dict:
    sig = {}
    for name in _seam_chain_kernel.arg_names:
        if name in CONSTEXPRS:
            sig[name] = "constexpr"
        elif name in INPUT_PTRS:
            sig[name] = f"*{dtype}"
        elif name in ("ev_ptr", "trow_ptr"):
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def ptxas_info(family: str, dk: int, dv: int, launch: ChainLaunch, dtype: str, arch: int) -> str:
    bk, bv, nw, pf = launch.resolve(family, dk, dv)
    values = dict(FAMILY=_FAMILY_CODE[family], BLOCK_K=bk, BLOCK_V=bv, COMPOSE_CHUNK=launch.compose_chunk,
                  PREFETCH=pf)
    names = _seam_chain_kernel.arg_names
    src = ASTSource(fn=_seam_chain_kernel, signature=signature(dtype),
                    constexprs={(names.index(n),): v for n, v in values.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": nw})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    return (f"BLOCK_K={bk} BLOCK_V={bv} warps={nw} prefetch={int(pf)}: registers={regs.group(1) if regs else '?'} "
            f"spill stores={spill.group(1) if spill else '?'} B spill loads={spill.group(2) if spill else '?'} B")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    a = ap.parse_args()
    for name, (family, dk, dv) in SHAPES.items():
        launches = [("default", ChainLaunch()), ("prefetch", ChainLaunch(prefetch=True)),
                    ("no-prefetch", ChainLaunch(prefetch=False))]
        if family == "delta":
            launches += [("whole-T (old)", ChainLaunch(compose_chunk=0, prefetch=False)),
                         ("chunk=32", ChainLaunch(compose_chunk=32)),
                         ("chunk=16,bv=16,warps=4", ChainLaunch(16, 4, 16))]
        for label, launch in launches:
            print(f"{name:16s} {family:6s} {label:24s} {ptxas_info(family, dk, dv, launch, a.dtype, a.arch)}")


if __name__ == "__main__":
    main()
