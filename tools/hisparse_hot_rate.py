"""Hot-buffer hit rate of HiSparse decode with per-KV-head selection, an explicit hot
buffer (default top-k + 2 blocks, the old sizing) against the auto one (`hot_blocks` 0:
sink + recent + Hkv x top-k, the union of the KV heads' picks): one layer on random K/V
(CPU torch paths by default), queries drifting step to step by `drift` x a unit Gaussian
(small drift: the selection changes slowly, as in decoding).

    PYTHONPATH=. python tools/hisparse_hot_rate.py            # ~30 s on one CPU core

Prints one JSON line per (drift, hot): hit rate, blocks fetched and staged per sequence
and step (after `warmup` steps).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.hisparse import HiSparseConfig  # noqa: E402
from engine.hisparse.layer_cache import HiSparseLayerCache  # noqa: E402
from engine.hisparse.metrics import HiSparseMetrics  # noqa: E402


def measure(hot: int, drift: float, a: argparse.Namespace) -> dict[str, Any]:
    cfg = HiSparseConfig(enabled=True, block_size=a.block, topk=a.topk, hot_blocks=hot, min_context=0)
    m = HiSparseMetrics()
    c = HiSparseLayerCache(0, a.hkv, a.d, cfg, a.batch, math.ceil((a.length + a.steps + a.block) / a.block),
                           torch.device("cpu"), torch.float32, None, m, b"x" * 16)
    g = torch.Generator().manual_seed(0)
    for b in range(a.batch):
        c.reset(b)
        c.append(b, torch.randn(a.length, a.hkv, a.d, generator=g), torch.randn(a.length, a.hkv, a.d, generator=g))
    q = torch.randn(a.batch, a.heads, a.d, generator=g)
    base = m.snapshot()
    for s in range(a.steps):
        if s == a.warmup:
            base = m.snapshot()
        q = q + drift * torch.randn(q.shape, generator=g)
        pos = torch.full((a.batch,), a.length + s)
        kv = torch.randn(a.batch, a.hkv, a.d, generator=g)
        c.decode_step(q, kv, kv, torch.arange(a.batch), pos, a.d ** -0.5, (a.length + s) // a.block + 1)
    sn = m.snapshot()
    d = {k: sn[k] - base[k] for k in ("blocks_attended", "blocks_fetched", "blocks_staged")}
    n = a.batch * (a.steps - a.warmup)
    return {"drift": drift, "hot_blocks": c.hot, "rows_per_slot": c.rows_per_slot,
            "hit_rate": 1 - d["blocks_fetched"] / d["blocks_attended"],
            "fetched_per_seq_step": d["blocks_fetched"] / n, "staged_per_seq_step": d["blocks_staged"] / n}


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hot", type=int, default=0, help="explicit hot buffer to compare (default top-k + 2)")
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--drifts", default="0.05,1.0")
    a = ap.parse_args(argv)
    rows = []
    for drift in (float(x) for x in a.drifts.split(",")):
        for hot in (a.hot or a.topk + 2, 0):
            rows.append(measure(hot, drift, a))
            print(json.dumps(rows[-1]))
    return rows


if __name__ == "__main__":
    main()
