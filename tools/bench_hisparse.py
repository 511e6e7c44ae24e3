"""HiSparse offload benchmark (issue 20): device memory per sequence, decode throughput and
fidelity, HiSparse against dense paged attention, in one process.

    python tools/bench_hisparse.py                 # GPU box: bench presets at 32k/128k/256k
    python tools/bench_hisparse.py --presets qwen3next-bench --lengths 131072
    python tools/bench_hisparse.py --quick         # CPU, a tiny preset, under a minute
    python tools/bench_hisparse.py --phases memory,decode --lengths 32768,131072
    python tools/bench_hisparse.py --phases decode --lengths 262144 --merge   # one file, several commands

Phases (the JSON, docs/results/hisparse-<date>.json or --json-path, is rewritten after
each one, `complete` false until the end):
1. memory: per preset and context length, the cache bytes one sequence holds on the
   device, dense (paged KV of full layers, window rings, linear states) and HiSparse (hot
   buffer + staging rows + block summaries of full layers, the same rings and states),
   measured as the bytes of the cache tensors allocated for one sequence (on CUDA also
   the allocator's delta); sequences that fit = the device budget (free memory after the
   model, times 0.9, less a 4 GiB activation reserve, as the engine sizes its cache; on
   the CPU `--memory-budget-gib`) over those bytes; for HiSparse also with the host
   budget over its host mirror's bytes (`hisparse_seqs_fit_with_host`).
2. decode: tokens/s of `ModelRunner.decode` at batch 1, at the largest dense batch that
   fits, at the largest HiSparse batch that fits and at the smaller of the two (equal
   batch) for both. Largest batch: the device budget (as in the memory phase) over the
   device bytes per sequence; for HiSparse also the host budget (`--host-budget-gib`,
   default 0.7 x MemAvailable) over the bytes of its host mirror per sequence (every
   full-layer block); no fixed cap unless `--max-batch`. A point that runs out of memory
   is retried with 15% fewer sequences (recorded). Contexts are filled with random K/V (dense: written
   into the paged pool; HiSparse: appended through the layer caches, so blocks are sealed
   and stored as in a prefill); linear states stay zero. Timing: `--decode-steps` steps
   after two untimed ones, device synchronised. The model's max positions are raised to
   the longest length measured (RoPE has no limit; the bench presets say 128k).
3. attention mass (bench presets, random weights, a random prompt of `--mass-length`
   tokens prefilled for real): per decode step, full layer and head, the share of the
   exact softmax attention mass that falls on the blocks HiSparse selected.
4. quality (trained tiny models under models/, `--quality-tasks`): per request a budget
   of 25% of its blocks resident (`--quality-budget`; `topk = ceil(0.25 * blocks) - sink
   - recent`):
   next-token KL(dense || HiSparse) over the dense greedy answer (teacher forced; prefill
   is exact either way, so only decode steps count), top-1 agreement, and the task score
   of free greedy generation, HiSparse minus dense, in points.

`summary`: `kv_memory_reduction_128k` (dense / HiSparse bytes per sequence at 131072),
`decode_throughput_ratio_equal_batch_128k` (HiSparse / dense tokens/s at the equal
batch, the smaller of the two largest batches), `total_throughput_gain_128k` (HiSparse tokens/s at its largest batch /
dense tokens/s at its largest batch), `quality_delta_points` (mean task score delta);
null where not measured (e.g. `--quick` measures no 128k point). Figures are only ever
measured, never estimated. Blocks go to this process's pinned memory unless `--store
SOCKET` names a kvstore daemon.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.cache.manager import PAGED, CacheConfig, CacheManager, cache_specs  # noqa: E402
from engine.hisparse import HiSparseConfig, HiSparseOffload  # noqa: E402
from engine.hisparse.layer_cache import HiSparseLayerCache  # noqa: E402
from engine.models.layers.base import ExternalKVCache  # noqa: E402
from engine.models.presets import get_preset  # noqa: E402
from engine.models.weights import build_model  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.runtime.sequence import Sequence  # noqa: E402
from tools.hisparse_quality import dense_manager, hisparse_manager, phase_quality  # noqa: E402
from tools.results import write_json  # noqa: E402

FULL_LENGTHS = (32768, 131072, 262144)
FULL_PRESETS = ("qwen3next-bench",)
QUICK_LENGTHS = (256, 512)
QUICK_PRESETS = ("qwen3next-tiny",)
QUALITY_PRESETS = ("qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny")
ACTIVATION_RESERVE_BYTES = 4 << 30
#: share of the host's available memory the HiSparse mirrors of one decode point may take
HOST_SHARE = 0.7
LENGTH_128K = 131072


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU, a tiny preset, short contexts (CI)")
    p.add_argument("--presets", help="comma list (default: qwen3next-bench; quick: qwen3next-tiny)")
    p.add_argument("--lengths", help="comma list of context lengths (default 32768,131072,262144)")
    p.add_argument("--block", type=int, help="HiSparse block size (default 64; quick 16)")
    p.add_argument("--topk", type=int, help="HiSparse top-k blocks (default 32; quick 4)")
    p.add_argument("--hot", type=int, help="HiSparse hot-buffer blocks (default 0: auto, sink + recent + KV heads x top-k; quick 8)")
    p.add_argument("--max-batch", type=int,
                   help="cap on the decode batch (default 0: none, the largest that fits; quick 2)")
    p.add_argument("--decode-steps", type=int, help="timed decode steps (default 8; quick 2)")
    p.add_argument("--mass-length", type=int, help="prompt tokens of the attention-mass phase (default 8192)")
    p.add_argument("--mass-steps", type=int, default=4, help="decode steps of the attention-mass phase")
    p.add_argument("--quality-presets", help="trained tiny models (default: those under models/)")
    p.add_argument("--quality-tasks", default="fact,twohop", help="workload tasks of the quality phase")
    p.add_argument("--quality-n", type=int, help="requests per task (default 8; quick 1)")
    p.add_argument("--quality-block", type=int, default=4,
                   help="HiSparse block size of the quality phase (4 beat 8 and 16 at a 25%% budget, docs/hisparse.md)")
    p.add_argument("--quality-budget", type=float, default=0.25,
                   help="share of a request's blocks resident in the quality phase (the issue's 25%%)")
    p.add_argument("--quality-sink", type=int, default=1, help="sink blocks of the quality phase (inside the budget)")
    p.add_argument("--quality-recent", type=int, default=1,
                   help="recent blocks of the quality phase (inside the budget)")
    p.add_argument("--quality-dense-layers", type=int, default=0,
                   help="first full-attention layers left dense in the quality phase")
    p.add_argument("--quality-summary", default="minmax", help="block summary of the quality phase (minmax, mean)")
    p.add_argument("--quality-per-head", action=argparse.BooleanOptionalAction, default=True,
                   help="select blocks per KV head in the quality phase (default; --no-quality-per-head: one set)")
    p.add_argument("--per-kv-head", action=argparse.BooleanOptionalAction, default=True,
                   help="select blocks per KV head in the memory, decode and mass phases (default)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="decode phase: HiSparse through the runner's decode CUDA graphs where CUDA (default; dense "
                        "always); each point records what the graphs did under `graphs`")
    p.add_argument("--phases", default="memory,decode,mass,quality", help="which phases to run")
    p.add_argument("--memory-budget-gib", type=float, default=1.0, help="device budget on the CPU (GiB)")
    p.add_argument("--host-budget-gib", type=float,
                   help="host memory the HiSparse mirrors of one decode point may take (caps the HiSparse batch; "
                        f"default {HOST_SHARE} x MemAvailable)")
    p.add_argument("--store", help="kvstore daemon socket for the blocks (default: this process's memory)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present; quick: cpu)")
    p.add_argument("--json-path", help="output file (default docs/results/hisparse-<date>.json)")
    p.add_argument("--merge", action="store_true",
                   help="keep the results of phases not run now from an existing --json-path file (split a long "
                        "run into several commands)")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    device = args.device or ("cpu" if q or not torch.cuda.is_available() else "cuda")
    return {
        "device": device,
        "dtype": "float32" if device == "cpu" else "bfloat16",
        "presets": (args.presets or ",".join(QUICK_PRESETS if q else FULL_PRESETS)).split(","),
        "lengths": [int(x) for x in (args.lengths or ",".join(map(str, QUICK_LENGTHS if q else FULL_LENGTHS))).split(",")],
        "block": args.block or (16 if q else 64),
        "topk": args.topk or (4 if q else 32),
        "hot": args.hot if args.hot is not None else (8 if q else 0),
        "max_batch": (args.max_batch if args.max_batch is not None else (2 if q else 0)) or None,
        "decode_steps": args.decode_steps or (2 if q else 8),
        "mass_length": args.mass_length or (128 if q else 8192),
        "mass_steps": args.mass_steps if not q else 2,
        "quality_presets": (args.quality_presets or ",".join(
            ("qwen3next-tiny",) if q else [p for p in QUALITY_PRESETS if (ROOT / "models" / p).is_dir()])).split(","),
        "quality_tasks": args.quality_tasks.split(",") if not q else ["fact"],
        "quality_n": args.quality_n or (1 if q else 8),
        "quality_block": args.quality_block,
        "quality_budget": args.quality_budget,
        "per_kv_head": args.per_kv_head,
        "graphs": args.graphs,
        "quality_variant": dict(sink_blocks=args.quality_sink, recent_blocks=args.quality_recent,
                                dense_layers=args.quality_dense_layers, summary=args.quality_summary,
                                per_kv_head=args.quality_per_head),
        "phases": args.phases.split(","),
        "memory_budget_gib": args.memory_budget_gib,
        "host_budget_gib": args.host_budget_gib,
        "store": args.store,
        "quick": q,
    }


# --------------------------------------------------------------------------- helpers
def _model(preset: str, device: torch.device, dtype: torch.dtype, max_len: int):
    """The preset's model (random weights for bench presets) with max positions >= max_len."""
    cfg = get_preset(preset)
    if cfg.max_position_embeddings < max_len:
        cfg = replace(cfg, max_position_embeddings=max_len)
    return build_model(cfg, device=device, dtype=dtype)


def _hs_config(s: dict[str, Any], **kw: Any) -> HiSparseConfig:
    base = dict(enabled=True, block_size=s["block"], topk=s["topk"], hot_blocks=s["hot"], min_context=0,
                per_kv_head=s["per_kv_head"])
    base.update(kw)
    return HiSparseConfig(**base)


def _store(s: dict[str, Any]):
    if not s["store"]:
        return None
    from engine.hisparse.daemon_store import DaemonBlockStore

    return DaemonBlockStore(s["store"])


def _cache_tensor_bytes(manager: CacheManager) -> int:
    total = 0
    for layer in manager.layers:
        if isinstance(layer, HiSparseLayerCache):
            t = layer.table
            tensors = (layer.k_pool, layer.v_pool, layer.summaries, t.row_of, t.row_block, t.last_use)
        else:
            tensors = [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _budget(s: dict[str, Any], device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9 - ACTIVATION_RESERVE_BYTES), "0.9 x free CUDA memory after the model - 4 GiB"
    return int(s["memory_budget_gib"] * (1 << 30)), f"--memory-budget-gib {s['memory_budget_gib']}"


# --------------------------------------------------------------------------- phases
def phase_memory(s: dict[str, Any], out: dict[str, Any]) -> None:
    device = torch.device(s["device"])
    dtype = getattr(torch, s["dtype"])
    for preset in s["presets"]:
        model = _model(preset, device, dtype, max(s["lengths"]) + 64)
        budget, how = _budget(s, device)
        host_budget, host_how = _host_budget(s)
        rows = {}
        for length in s["lengths"]:
            row: dict[str, Any] = {}
            for name in ("dense", "hisparse"):
                _sync(device)
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                if name == "dense":
                    manager = dense_manager(model, 1, length)
                else:
                    manager, _off = hisparse_manager(model, _hs_config(s), 1, length)
                nbytes = _cache_tensor_bytes(manager)
                row[f"{name}_bytes_per_seq"] = nbytes
                if device.type == "cuda":
                    row[f"{name}_allocator_delta"] = torch.cuda.memory_allocated(device) - before
                row[f"{name}_seqs_fit"] = max(0, budget // nbytes)
                del manager
            row["reduction"] = row["dense_bytes_per_seq"] / row["hisparse_bytes_per_seq"]
            host = _offloaded_bytes_per_seq(model, s, length)
            row["hisparse_host_bytes_per_seq"] = host
            row["hisparse_seqs_fit_with_host"] = min(row["hisparse_seqs_fit"], host_budget // host)
            rows[str(length)] = row
        entry = out.setdefault("memory", {}).setdefault(preset, {"lengths": {}})
        entry.update(budget_bytes=budget, budget=how, host_budget_bytes=host_budget, host_budget=host_how)
        entry["lengths"].update(rows)  # --merge keeps lengths measured by an earlier command
        del model


def _randn(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random K/V for a context fill, drawn on the device (host draws of 128k-token
    contexts would dominate the run); seeded from `gen` so runs repeat."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    dgen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=dgen, device=device, dtype=torch.float32).to(dtype)


def fill_dense_context(runner: ModelRunner, seqs: list[Sequence], length: int, gen: torch.Generator) -> None:
    cache = runner.cache
    for seq in seqs:
        cache.ensure_capacity(seq, length)
        for a in range(0, length, 8192):
            b = min(length, a + 8192)
            slots = cache.flat_slots(seq, a, b)
            for spec, layer in zip(cache.specs, cache.layers):
                if spec.kind == PAGED:
                    shape = (b - a, spec.num_kv_heads, spec.head_dim)
                    layer.write(slots, _randn(shape, cache.device, cache.dtype, gen),
                                _randn(shape, cache.device, cache.dtype, gen))
        seq.num_computed_tokens = length


def fill_hisparse_context(runner: ModelRunner, seqs: list[Sequence], length: int, gen: torch.Generator) -> None:
    cache = runner.cache
    for seq in seqs:
        for a in range(0, length, 8192):
            b = min(length, a + 8192)
            for layer in cache.layers:
                if isinstance(layer, HiSparseLayerCache):
                    shape = (b - a, layer.num_kv_heads, layer.head_dim)
                    layer.append(seq.slot, _randn(shape, layer.device, cache.dtype, gen),
                                 _randn(shape, layer.device, cache.dtype, gen))
        seq.num_computed_tokens = length


def decode_rate(runner: ModelRunner, seqs: list[Sequence], steps: int) -> float:
    """Tokens/s of `runner.decode` over `seqs`: two untimed steps, then `steps` timed ones,
    the device synchronised around them."""
    tokens = [1] * len(seqs)
    for _ in range(2):
        runner.decode(seqs, tokens)
    _sync(runner.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.decode(seqs, tokens)
    _sync(runner.device)
    return len(seqs) * steps / (time.perf_counter() - t0)


def _offloaded_bytes_per_seq(model, s: dict[str, Any], length: int) -> int:
    """Bytes of one sequence's sealed blocks in the block store (every full layer)."""
    esz = torch.empty((), dtype=model.dtype).element_size()
    per_block = sum(2 * s["block"] * spec.num_kv_heads * spec.head_dim * esz
                    for spec in cache_specs(model) if spec.kind == PAGED)
    return (length // s["block"]) * per_block


def _decode_point(model, s: dict[str, Any], kind: str, batch: int, length: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch * 7 + length)
    off = None
    if kind == "dense":
        manager = dense_manager(model, batch, length + s["decode_steps"] + 2)
    else:
        manager, off = hisparse_manager(model, _hs_config(s), batch, length + s["decode_steps"] + 2, _store(s))
    # dense always, HiSparse unless --no-graphs: the runner's decode CUDA graphs where CUDA
    runner = ModelRunner(model, manager, cuda_graphs=None if kind == "dense" or s["graphs"] else False)
    seqs = [manager.allocate(Sequence(f"{kind}{i}")) for i in range(batch)]
    (fill_dense_context if kind == "dense" else fill_hisparse_context)(runner, seqs, length, gen)
    rate = decode_rate(runner, seqs, s["decode_steps"])
    point: dict[str, Any] = {"batch": batch, "tokens_per_s": rate,
                             "graphs": runner.graphs.report() if runner.graphs is not None else {"used": False}}
    if off is not None:
        snap = off.snapshot()
        point.update(hot_hit_rate=snap["hot_hit_rate"], blocks_fetched_per_step=snap["blocks_fetched_per_step"],
                     read_bytes_per_s=snap["read_bytes_per_s"])
        off.close()
    for seq in seqs:
        manager.free(seq)
    return point


def _host_budget(s: dict[str, Any]) -> tuple[int, str]:
    """Host bytes the offloaded blocks (the layer caches' mirrors) of one decode point may take."""
    if s["host_budget_gib"] is not None:
        return int(s["host_budget_gib"] * (1 << 30)), f"--host-budget-gib {s['host_budget_gib']}"
    avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(avail * HOST_SHARE), f"{HOST_SHARE} x MemAvailable"


def _largest_point(model, s: dict[str, Any], kind: str, batch: int, length: int) -> dict[str, Any]:
    """The decode point at `batch`, or at the largest batch below it that runs (out of
    memory: 15% fewer sequences, at most 3 times; each failure is recorded)."""
    failures = []
    for _ in range(4):
        try:
            point = _decode_point(model, s, kind, batch, length)
            if failures:
                point["out_of_memory_at"] = failures
            return point
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # recorded, never guessed
            if "out of memory" not in str(exc).lower() and not isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            failures.append(batch)
            if s["device"] == "cuda":
                torch.cuda.empty_cache()
            batch = max(1, int(batch * 0.85))
    return {"batch": batch, "error": f"out of memory at batches {failures}"}


def phase_decode(s: dict[str, Any], out: dict[str, Any], save) -> None:
    device = torch.device(s["device"])
    dtype = getattr(torch, s["dtype"])
    host_budget, host_how = _host_budget(s)
    for preset in s["presets"]:
        model = _model(preset, device, dtype, max(s["lengths"]) + s["decode_steps"] + 64)
        budget, _ = _budget(s, device)
        res: dict[str, Any] = out.setdefault("decode", {}).setdefault(preset, {})
        for length in s["lengths"]:
            # the largest batches: device budget over device bytes per sequence (the memory
            # phase's measurement, taken again here), HiSparse also host budget over its mirror
            dense_bytes = _cache_tensor_bytes(dense_manager(model, 1, length))
            hs_bytes = _cache_tensor_bytes(hisparse_manager(model, _hs_config(s), 1, length)[0])
            host_per_seq = _offloaded_bytes_per_seq(model, s, length)
            cap = s["max_batch"] or 1 << 30
            dense_max = max(1, min(cap, budget // dense_bytes))
            host_cap = max(1, host_budget // max(1, host_per_seq))
            hs_max = max(1, min(cap, budget // hs_bytes, host_cap))
            equal = min(dense_max, hs_max)
            row: dict[str, Any] = {"dense": {}, "hisparse": {}}
            row.update(dense_max_batch=dense_max, hisparse_max_batch=hs_max, equal_batch=equal,
                       dense_bytes_per_seq=dense_bytes, hisparse_bytes_per_seq=hs_bytes,
                       offloaded_bytes_per_seq=host_per_seq, hisparse_host_cap=host_cap, host_budget_bytes=host_budget,
                       host_budget=host_how, device_budget_bytes=budget,
                       batch_cap=s["max_batch"])
            res[str(length)] = row  # saved as it fills: a failing point keeps the ones before it
            for kind, batches in (("dense", (1, equal, dense_max)), ("hisparse", (1, equal, hs_max))):
                for batch in sorted(set(batches)):
                    big = batch == (dense_max if kind == "dense" else hs_max) and batch > 1
                    try:
                        point = (_largest_point if big else _decode_point)(model, s, kind, batch, length)
                    except Exception as exc:  # recorded with where it came from, then re-raised
                        row[kind][str(batch)] = {"batch": batch, "error": f"{type(exc).__name__}: {exc}"[:400],
                                                 "error_frames": _frames(exc)}
                        save()
                        raise
                    row[kind][str(batch)] = point
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    save()
            res[str(length)] = row
            save()
        del model


def _frames(exc: BaseException, n: int = 8) -> list[str]:
    """The last `n` frames of `exc`'s traceback, "file:line in function"."""
    import traceback

    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in traceback.extract_tb(exc.__traceback__)[-n:]]


class _MassProbe(ExternalKVCache):
    """Wraps a HiSparse layer cache: after each decode step, the share of the exact softmax
    attention mass (all positions) on the blocks the layer selected, per head."""

    def __init__(self, inner: HiSparseLayerCache, shares: list[float]) -> None:
        self.inner, self.shares = inner, shares

    def attend_prefill(self, q, k, v, ctx, scale):
        return self.inner.attend_prefill(q, k, v, ctx, scale)

    def attend_decode(self, q, k, v, ctx, scale):
        out = self.inner.attend_decode(q, k, v, ctx, scale)
        bs = self.inner.block
        selected = self.inner.last_selection.head_lists(self.inner.num_kv_heads)
        for b, slot in enumerate(ctx.host_slots):
            kk, _ = self.inner.context_kv(slot)
            group = q.shape[1] // kk.shape[1]
            scores = torch.einsum("hd,lhd->hl", q[b].float(), kk.float().repeat_interleave(group, dim=1)) * scale
            probs = torch.softmax(scores, dim=-1)
            sel = torch.zeros(kk.shape[1], kk.shape[0], dtype=torch.bool, device=kk.device)  # [Hkv, L]
            for h, blocks in enumerate(selected[b]):
                for j in blocks:
                    sel[h, j * bs:(j + 1) * bs] = True
            self.shares.extend((probs * sel.repeat_interleave(group, dim=0)).sum(-1).tolist())
        return out

    def reset(self, slot):
        self.inner.reset(slot)

    def release(self, slot):
        self.inner.release(slot)


def phase_mass(s: dict[str, Any], out: dict[str, Any]) -> None:
    device = torch.device(s["device"])
    dtype = getattr(torch, s["dtype"])
    length = s["mass_length"]
    for preset in s["presets"]:
        model = _model(preset, device, dtype, length + s["mass_steps"] + 64)
        cfg = _hs_config(s)
        off = HiSparseOffload(cfg, None, 1, length + s["mass_steps"] + 8, device, dtype)
        shares: list[float] = []
        manager = CacheManager(cache_specs(model), CacheConfig(block_size=16, num_blocks=0, num_slots=1), device,
                               dtype, external_kv=lambda i, spec: _MassProbe(off.layer_cache(i, spec), shares))
        runner = ModelRunner(model, manager, cuda_graphs=False)
        seq = manager.allocate(Sequence("mass"))
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size - 8, (length,), generator=gen).tolist()
        for a in range(0, length, 4096):
            logits = runner.prefill(seq, prompt[a:a + 4096])
        tok = int(logits.argmax())
        for _ in range(s["mass_steps"]):
            tok = int(runner.decode([seq], [tok])[0].argmax())
        blocks = math.ceil(length / cfg.block_size)
        out.setdefault("attention_mass", {})[preset] = {
            "length": length, "blocks": blocks, "selected_blocks": min(blocks, cfg.topk + cfg.sink_blocks + cfg.recent_blocks),
            "mean_share": sum(shares) / len(shares), "min_share": min(shares), "samples": len(shares)}
        manager.free(seq)
        del model, runner, manager


# --------------------------------------------------------------------------- report
def summarize(out: dict[str, Any]) -> dict[str, Optional[float]]:
    key = str(LENGTH_128K)
    summary: dict[str, Optional[float]] = {"kv_memory_reduction_128k": None,
                                           "decode_throughput_ratio_equal_batch_128k": None,
                                           "total_throughput_gain_128k": None, "quality_delta_points": None}
    for preset, m in out.get("memory", {}).items():
        if key in m["lengths"]:
            summary["kv_memory_reduction_128k"] = m["lengths"][key]["reduction"]
            d = out.get("decode", {}).get(preset, {}).get(key)
            if d:
                eq = str(d.get("equal_batch", d["dense_max_batch"]))
                dense_eq, hs_eq = d["dense"].get(eq, {}), d["hisparse"].get(eq, {})
                hs_max = d["hisparse"].get(str(d["hisparse_max_batch"]), {})
                if "tokens_per_s" in dense_eq and "tokens_per_s" in hs_eq:
                    summary["decode_throughput_ratio_equal_batch_128k"] = hs_eq["tokens_per_s"] / dense_eq["tokens_per_s"]
                dense_max = d["dense"].get(str(d["dense_max_batch"]), {})
                if "tokens_per_s" in dense_max and "tokens_per_s" in hs_max:
                    summary["total_throughput_gain_128k"] = hs_max["tokens_per_s"] / dense_max["tokens_per_s"]
            break
    deltas = [t["delta_points"] for q in out.get("quality", {}).values() for t in q.get("tasks", {}).values()]
    if deltas:
        summary["quality_delta_points"] = sum(deltas) / len(deltas)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    s = _settings(args)
    date = _dt.date.today().isoformat()
    path = Path(args.json_path) if args.json_path else ROOT / "docs" / "results" / f"hisparse-{date}.json"
    device = torch.device(s["device"])
    doc: dict[str, Any] = {"tool": "tools/bench_hisparse.py", "command": " ".join(["python", "tools/bench_hisparse.py",
                                                                                   *(argv if argv is not None else sys.argv[1:])]),
                           "date": date, "device": s["device"], "host": platform.node(), "settings": s,
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                           "results": {}, "summary": summarize({}), "complete": False}

    def save() -> None:
        doc["summary"] = summarize(doc["results"])
        write_json(path, doc)

    if args.merge and path.exists():
        old = json.loads(path.read_text())
        doc["results"] = {k: v for k, v in old.get("results", {}).items()}
        doc["runs"] = old.get("runs", []) + [{"command": old.get("command"), "settings": old.get("settings")}]
    res = doc["results"]
    t0 = time.perf_counter()
    doc["phase_seconds"] = {}
    phases = {"memory": lambda: phase_memory(s, res), "decode": lambda: phase_decode(s, res, save),
              "mass": lambda: phase_mass(s, res), "quality": lambda: phase_quality(s, res)}
    for name, run in phases.items():
        if name in s["phases"]:
            t1 = time.perf_counter()
            run()
            doc["phase_seconds"][name] = round(time.perf_counter() - t1, 2)
            save()
    doc["complete"] = True
    doc["seconds"] = time.perf_counter() - t0
    save()
    print(json.dumps({"json": str(path), "summary": doc["summary"], "seconds": round(doc["seconds"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
