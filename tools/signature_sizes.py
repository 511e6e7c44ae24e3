"""Bytes per cached segment signature, per preset (family, scale) and segment length.

For each preset and segment length n, the table gives the bytes a signature holds by
part (engine.pic.signature): full-attention K/V, sliding-window K/V, linear states
(E and E_tail), linear transition operators T_tail, conv tails, and the total; and, for
scale, the bytes of the full-attention K/V alone and the ratio total / full K/V.

- `--mode bound` (default): from the configs, with every delta-rule head's T stored (the
  upper bound; long segments drop the heads whose decay product has underflowed, which
  depends on the weights and the text). Cheap for every preset, bench scale included.
- `--mode measured`: compute real signatures of a workload's documents with the model's
  weights (trained when present, else seeded init; the table says which) and report the
  mean bytes, forgotten heads dropped. Tiny presets only (it runs the model).

    PYTHONPATH=. python tools/signature_sizes.py [--mode bound|measured] [--presets ...]
        [--lengths 64,256,1024,4096] [--seam 16] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from engine.models.config import FULL, RECURRENCE_FAMILY, SWA, ModelConfig
from engine.models.presets import get_preset, list_presets
from engine.pic.config import PicConfig

PARTS = ("full_kv", "swa_kv", "linear_state", "linear_tail_state", "linear_transition", "conv_tail")
ESIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def bound_bytes(cfg: ModelConfig, n: int, anchor: int = 1, seam: int = 16) -> dict[str, int]:
    """Signature bytes by part for a segment of n tokens (all delta heads' T stored)."""
    esz = ESIZE[cfg.dtype]
    a, lin = cfg.attention, cfg.linear
    window = a.sliding_window if SWA in cfg.layers else None
    split = min(n, PicConfig(seam=seam).effective_seam(window))
    rows = anchor + n
    out = dict.fromkeys(PARTS, 0)
    for kind in cfg.layers:
        if kind == FULL:
            out["full_kv"] += 2 * rows * a.num_kv_heads * a.head_dim * esz
        elif kind == SWA:
            out["swa_kv"] += 2 * min(rows, a.sliding_window) * a.num_kv_heads * a.head_dim * esz
        else:
            h, dk, dv = lin.num_v_heads, lin.key_dim, lin.value_dim
            out["linear_state"] += h * dk * dv * 4
            has_tail = split < n
            if has_tail and (anchor or split):
                out["linear_tail_state"] += h * dk * dv * 4
            if has_tail:
                fam = RECURRENCE_FAMILY[kind]
                out["linear_transition"] += {"scalar": h, "diag": h * dk, "delta": h * dk * dk, "kda": h * dk * dk}[fam] * 4
            width = lin.conv_width(kind)
            if width:
                channels = 2 * lin.num_heads * dk + h * dv  # [q, k, v] (mamba2: [x, B, C]) conv inputs
                out["conv_tail"] += channels * min(rows, width - 1) * esz
    return out


def measured_bytes(preset: str, lengths: list[int], seam: int, samples: int) -> tuple[str, dict[int, dict]]:
    """Mean bytes by part of real signatures of `samples` segments of each length."""
    from engine.models.weights import load_model
    from engine.pic.compute import compute_signature

    loaded = load_model(preset)
    cfg = loaded.config
    window = cfg.attention.sliding_window if SWA in cfg.layers else None
    split_of = PicConfig(seam=seam).effective_seam(window)
    g = torch.Generator().manual_seed(0)
    text = _document_bytes()
    out = {}
    for n in lengths:
        acc = dict.fromkeys(PARTS, 0)
        for _ in range(samples):
            start = int(torch.randint(0, max(1, len(text) - n), (1,), generator=g))
            ids = list(text[start:start + n])
            sig = compute_signature(loaded.model, ids, [256], min(n, split_of))
            for k, v in sig.bytes_by_part().items():
                acc[k] += v
        out[n] = {k: v // samples for k, v in acc.items()}
    return loaded.source, out


def _document_bytes() -> bytes:
    """A long run of workload document text (the `rag` generator's documents)."""
    from tools.workloads import iter_requests

    docs = []
    for r in iter_requests("rag", 8, 0):
        docs.extend(s.text for s in r.segments if s.cache)
    return "".join(docs).encode()


def table(rows: list[dict]) -> str:
    head = "| preset | n | full KV | SWA KV | linear E+E_tail | linear T | conv | total | full KV only | total / full KV |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        p = r["parts"]
        total = sum(p.values())
        ratio = f"{total / p['full_kv']:.1f}x" if p["full_kv"] else "-"
        lines.append(f"| {r['preset']} | {r['n']} | {_h(p['full_kv'])} | {_h(p['swa_kv'])} | "
                     f"{_h(p['linear_state'] + p['linear_tail_state'])} | {_h(p['linear_transition'])} | "
                     f"{_h(p['conv_tail'])} | {_h(total)} | {_h(p['full_kv'])} | {ratio} |")
    return "\n".join(lines)


def _h(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("bound", "measured"), default="bound")
    p.add_argument("--presets", default=None, help="comma list (default: all; tiny ones for measured)")
    p.add_argument("--lengths", default="64,256,1024,4096")
    p.add_argument("--seam", type=int, default=16)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    if a.presets:
        names = a.presets.split(",")
    else:
        names = [c.name for c in list_presets("tiny" if a.mode == "measured" else None)]
    rows = []
    for name in names:
        if a.mode == "bound":
            cfg = get_preset(name)
            rows += [{"preset": name, "n": n, "parts": bound_bytes(cfg, n, seam=a.seam)} for n in lengths]
        else:
            source, by_n = measured_bytes(name, lengths, a.seam, a.samples)
            rows += [{"preset": name, "weights": source, "n": n, "parts": by_n[n]} for n in lengths]
    if a.json:
        print(json.dumps(rows))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
