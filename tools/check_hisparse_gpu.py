"""GPU check of HiSparse decode (engine/hisparse/layer_cache.py) on one full-attention layer
of qwen3next-bench's shape (16 query heads, 2 KV heads, head dim 256, bf16):

1. `exact`: a batch of sequences with a tiny hot buffer (blocks evicted and fetched back
   from the pinned host mirror every step, staging rows in use) decodes several steps; each
   step's output is compared, per KV head, with exact attention (float64, on the host) over
   the blocks that head selected, and each head's selection with the torch reference
   scoring (summaries from the true keys, `block_scores_reference` + `topk_blocks_reference`).
2. `graph`: `decode_step` captured in a CUDA graph and replayed against a twin cache run
   eagerly with the same inputs (outputs and selections must match).
3. `timing`: ms per decode step of the layer at 32k and 128k context, batch `--batch`:
   HiSparse `decode_step` (eager, and replayed from a graph when capture worked) vs dense
   `paged_decode_attention` over the whole context; the step includes the fetches of
   missing blocks (random queries: the selection changes every step); first one step under
   `torch.cuda.set_sync_debug_mode("error")` (`no_host_sync`: no device->host sync in it),
   and one step under engine/hisparse/sync_guard.py's `HostSyncGuard` (`host_sync_guard`:
   every synchronising or host<->device op it records, with the frames that led to it).

Every error recorded (host sync, graph capture) comes with `*_frames`: the last frames of
its traceback ("file:line in function"), so a failure is localised from the JSON alone.

    PYTHONPATH=. python tools/check_hisparse_gpu.py --json /tmp/check_hisparse.json   # H200, < 3 min
    PYTHONPATH=. python tools/check_hisparse_gpu.py --quick                             # CPU, small (CI)

The JSON is rewritten after each phase. Exit status 0 when every check passes, 1 if one
fails, 2 without CUDA (unless --quick).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.hisparse import HiSparseConfig  # noqa: E402
from engine.hisparse.layer_cache import HiSparseLayerCache  # noqa: E402
from engine.hisparse.metrics import HiSparseMetrics  # noqa: E402
from engine.hisparse.sync_guard import HostSyncGuard  # noqa: E402
from kernels.hisparse_select import block_scores_reference, topk_blocks_reference  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention  # noqa: E402

H, HKV, D = 16, 2, 256


def _cache(cfg: HiSparseConfig, slots: int, max_len: int, device: torch.device, dtype: torch.dtype,
           hkv: int, d: int) -> HiSparseLayerCache:
    return HiSparseLayerCache(3, hkv, d, cfg, slots, math.ceil(max_len / cfg.block_size), device, dtype, None,
                              HiSparseMetrics(), b"c" * 16)


def _frames(exc: BaseException, n: int = 8) -> list[str]:
    """The last `n` frames of `exc`'s traceback outside torch, then the innermost one (where
    torch raised), innermost last."""
    tb = traceback.extract_tb(exc.__traceback__)
    own = [f for f in tb if "/torch/" not in f.filename.replace("\\", "/")][-n:]
    if tb and (not own or own[-1] is not tb[-1]):
        own.append(tb[-1])
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in own]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) / math.sqrt(q.shape[-1]), -1)
    return torch.einsum("hl,lhd->hd", p, v)


def check_exact(device, dtype, p: dict[str, Any]) -> dict[str, Any]:
    bs, hkv, d, heads = p["block"], p["hkv"], p["d"], p["heads"]
    cfg = HiSparseConfig(enabled=True, block_size=bs, topk=p["topk"], hot_blocks=p["topk"] // 2 + 2, min_context=0)
    batch, n0, steps = p["exact_batch"], p["exact_len"], p["exact_steps"]
    cache = _cache(cfg, batch, n0 + steps + bs, device, dtype, hkv, d)
    gen = torch.Generator().manual_seed(0)
    ks = torch.randn(batch, n0 + steps, hkv, d, generator=gen).to(dtype)
    vs = torch.randn(batch, n0 + steps, hkv, d, generator=gen).to(dtype)
    lens = [n0 - 3 * b for b in range(batch)]
    for b in range(batch):
        cache.reset(b)
        cache.append(b, ks[b, :lens[b]].to(device), vs[b, :lens[b]].to(device))
    worst, sel_agree, sel_total = 0.0, 0, 0
    for step in range(steps):
        pos = [n + step for n in lens]
        q = torch.randn(batch, heads, d, generator=gen).to(dtype)
        kn = torch.stack([ks[b, pos[b]] for b in range(batch)])
        vn = torch.stack([vs[b, pos[b]] for b in range(batch)])
        cols = max(x // bs + 1 for x in pos)
        out = cache.decode_step(q.to(device), kn.to(device), vn.to(device), torch.arange(batch, device=device),
                                torch.tensor(pos, device=device), d ** -0.5, cols).cpu()
        chosen = cache.last_selection.head_lists(hkv)  # per sequence and KV head (selection per KV head)
        g = heads // hkv
        for b in range(batch):
            nb = pos[b] // bs + 1
            blocks = ks[b, :(nb - 1) * bs].float().view(nb - 1, bs, hkv, d)  # the full ones
            summ = torch.stack([blocks.amin(1), blocks.amax(1)], 1)[None]
            for h in range(hkv):
                ref = block_scores_reference(q[b:b + 1, h * g:(h + 1) * g].float(), summ[:, :, :, h:h + 1],
                                             torch.tensor([0]), torch.tensor([1]), torch.tensor([nb - 1]), nb - 1)
                k_ref = min(cfg.topk, max(1, nb - 2))
                want = sorted({0, nb - 1, *topk_blocks_reference(ref, k_ref)[0].tolist()})
                sel_agree += len(set(want) & set(chosen[b][h]))
                sel_total += len(want)
                idx = torch.cat([torch.arange(j * bs, min(pos[b] + 1, j * bs + bs)) for j in chosen[b][h]])
                exact = _attention(q[b, h * g:(h + 1) * g].float(), ks[b, idx][:, h:h + 1].float(),
                                   vs[b, idx][:, h:h + 1].float())
                worst = max(worst, float((out[b, h * g:(h + 1) * g].double() - exact).abs().max()))
    snap = cache.metrics.snapshot()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    agree = sel_agree / sel_total
    return {"max_abs_diff": worst, "tolerance": tol, "selection_agreement": agree, "blocks_fetched":
            snap["blocks_fetched"], "blocks_staged": snap["blocks_staged"], "hot_hit_rate": snap["hot_hit_rate"],
            "pass": worst <= tol and agree >= 0.97 and snap["blocks_fetched"] > 0}


def _filled(cfg, batch, length, device, dtype, hkv, d, seed=1) -> HiSparseLayerCache:
    cache = _cache(cfg, batch, length + 64 + cfg.block_size, device, dtype, hkv, d)
    g = torch.Generator(device=device).manual_seed(seed)
    for b in range(batch):
        cache.reset(b)
        for a in range(0, length, 8192):
            n = min(8192, length - a)
            cache.append(b, torch.randn(n, hkv, d, generator=g, device=device).to(dtype),
                         torch.randn(n, hkv, d, generator=g, device=device).to(dtype))
    return cache


class _Step:
    """Static inputs of `decode_step` for one cache and a graph of it."""

    def __init__(self, cache: HiSparseLayerCache, batch: int, length: int, heads: int, cols: int) -> None:
        dev, dt = cache.device, cache.k_pool.dtype
        self.cache, self.cols = cache, cols
        self.q = torch.zeros(batch, heads, cache.head_dim, device=dev, dtype=dt)
        self.k = torch.zeros(batch, cache.num_kv_heads, cache.head_dim, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        self.slots = torch.arange(batch, device=dev)
        self.pos = torch.full((batch,), length, device=dev, dtype=torch.long)
        self.out: Optional[torch.Tensor] = None
        self.graph = None

    def eager(self) -> torch.Tensor:
        return self.cache.decode_step(self.q, self.k, self.v, self.slots, self.pos, self.cache.head_dim ** -0.5,
                                      self.cols)

    def capture(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.eager()

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.eager()
        self.graph.replay()
        return self.out


def check_graph(device, dtype, p: dict[str, Any]) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need CUDA"}
    cfg = HiSparseConfig(enabled=True, block_size=p["block"], topk=p["topk"], hot_blocks=p["topk"] // 2 + 2,
                         min_context=0)
    batch, length = 4, p["exact_len"]
    a = _filled(cfg, batch, length, device, dtype, p["hkv"], p["d"])
    b = _filled(cfg, batch, length, device, dtype, p["hkv"], p["d"])
    cols = a.max_blocks
    sa, sb = _Step(a, batch, length, p["heads"], cols), _Step(b, batch, length, p["heads"], cols)
    gen = torch.Generator(device=device).manual_seed(7)
    worst, same_sel = 0.0, True
    try:
        for step in range(p["exact_steps"]):
            q = torch.randn(sa.q.shape, generator=gen, device=device).to(dtype)
            kv = torch.randn(sa.k.shape, generator=gen, device=device).to(dtype)
            for s in (sa, sb):
                s.q.copy_(q)
                s.k.copy_(kv)
                s.v.copy_(kv)
                s.pos.fill_(length + step)
            oa = sa.run().clone()
            if step == 0:  # warm-up step eager on a side stream, then capture (capture does not run)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    ob = sb.eager().clone()
                torch.cuda.current_stream().wait_stream(side)
                sb.capture()
            else:
                ob = sb.run().clone()
            torch.cuda.synchronize()
            worst = max(worst, float((oa.float() - ob.float()).abs().max()))
            same_sel &= a.last_selection.head_lists(p["hkv"]) == b.last_selection.head_lists(p["hkv"])
    except Exception as exc:  # noqa: BLE001 - the verdict is the record
        return {"capturable": False, "error": f"{type(exc).__name__}: {exc}"[:400], "error_frames": _frames(exc)}
    return {"capturable": True, "max_abs_diff_vs_eager": worst, "pass": worst <= 1e-2 and same_sel}


def _time(fn: Callable[[], Any], iters: int, device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def time_decode(device, dtype, p: dict[str, Any], length: int) -> dict[str, Any]:
    bs, batch, heads, hkv, d = p["block"], p["batch"], p["heads"], p["hkv"], p["d"]
    cfg = HiSparseConfig(enabled=True, block_size=bs, topk=p["topk"], hot_blocks=p["hot"], min_context=0)
    cache = _filled(cfg, batch, length, device, dtype, hkv, d)
    st = _Step(cache, batch, length, heads, cache.max_blocks)
    gen = torch.Generator(device=device).manual_seed(3)

    def step() -> None:
        st.q.copy_(torch.randn(st.q.shape, generator=gen, device=device).to(dtype))
        st.run()
        st.pos += 1

    row: dict[str, Any] = {"batch": batch, "length": length, "hot_blocks": cache.hot,
                           "staging_blocks": cache.rows_per_slot - cache.hot}
    if device.type == "cuda":  # one step with host synchronisations turned into errors
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            row["no_host_sync"] = True
        except RuntimeError as exc:
            row["no_host_sync"] = False
            row["host_sync_error"] = str(exc)[:300]
            row["host_sync_error_frames"] = _frames(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with HostSyncGuard(host_tensors=[cache.mirror_k, cache.mirror_v]) as guard:
        step()
    row["host_sync_guard"] = [str(r) for r in guard.records]
    row["aten_ops_per_step"] = guard.ops  # eager launch overhead: what a CUDA graph replay removes
    fetched0 = cache.metrics.snapshot()["blocks_fetched"]
    row["hisparse_eager_ms"] = _time(step, p["iters"], device)
    row["blocks_fetched_per_seq_step"] = (cache.metrics.snapshot()["blocks_fetched"] - fetched0) / (
        batch * (p["iters"] + 3))
    row["hot_hit_rate"] = cache.metrics.snapshot()["hot_hit_rate"]
    if device.type == "cuda":
        try:
            st.capture()
            row["hisparse_graph_ms"] = _time(step, p["iters"], device)
        except Exception as exc:  # noqa: BLE001
            row["hisparse_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["hisparse_graph_error_frames"] = _frames(exc)
    del cache, st
    # dense: paged attention over the whole context (the work a dense full layer does per step)
    pages = length // 16 + 8
    kp = torch.randn(batch * pages, 16, hkv, d, device=device).to(dtype)
    vp = torch.randn_like(kp)
    tables = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), length + 1, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, d, device=device).to(dtype)
    row["dense_ms"] = _time(lambda: paged_decode_attention(q, kp, vp, tables, lens, d ** -0.5), p["iters"], device)
    best = min(row.get("hisparse_graph_ms", math.inf), row["hisparse_eager_ms"])
    row["hisparse_over_dense_time"] = best / row["dense_ms"]
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, small shapes (CI)")
    ap.add_argument("--json", help="output file (default: print only)")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hot", type=int, default=0, help="timing: hot-buffer blocks (0: auto, the step's union)")
    args = ap.parse_args(argv)
    if args.quick:
        device, dtype = torch.device("cpu"), torch.float32
        p = dict(block=8, topk=4, hot=8, hkv=2, d=16, heads=4, exact_batch=2, exact_len=60, exact_steps=3, batch=2,
                 iters=2)
        lengths = [128]
    else:
        if not torch.cuda.is_available():
            print("check_hisparse_gpu: no CUDA device (use --quick on the CPU)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        p = dict(block=64, topk=32, hot=args.hot, hkv=HKV, d=D, heads=H, exact_batch=4, exact_len=4096, exact_steps=6,
                 batch=args.batch, iters=20)
        lengths = [int(x) for x in args.lengths.split(",")]
    doc: dict[str, Any] = {"tool": "tools/check_hisparse_gpu.py", "device": str(device), "dtype": str(dtype),
                           "params": p, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1))

    t0 = time.perf_counter()
    doc["exact"] = check_exact(device, dtype, p)
    save()
    doc["graph"] = check_graph(device, dtype, p)
    save()
    doc["timing"] = {}
    for length in lengths:
        doc["timing"][str(length)] = time_decode(device, dtype, p, length)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["seconds"] = time.perf_counter() - t0
    doc["pass"] = bool(doc["exact"]["pass"] and doc["graph"].get("pass", True)
                       and all(r.get("no_host_sync", True) and not r["host_sync_guard"]
                               for r in doc["timing"].values()))
    save()
    print(json.dumps(doc, indent=1))
    return 0 if doc["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
