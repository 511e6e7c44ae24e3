"""tools/bench_hisparse.py's quality phase (HiSparse against dense decoding on the trained
tiny models: task score, next-token KL, top-1 agreement at a resident-block budget) and
the two cache builders every phase of that benchmark uses."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from engine.cache.manager import CacheConfig, CacheManager, cache_specs
from engine.hisparse import HiSparseConfig, HiSparseOffload
from engine.models.weights import load_model
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence


def dense_manager(model, slots: int, length: int) -> CacheManager:
    """A paged cache of `slots` sequences of `length` tokens (blocks of 16)."""
    return CacheManager.for_model(model, CacheConfig.for_tokens(length * slots, num_slots=slots, block_size=16))


def hisparse_manager(model, cfg: HiSparseConfig, slots: int, length: int, store=None):
    """A cache whose full-attention layers are HiSparse's, and its HiSparseOffload."""
    off = HiSparseOffload(cfg, store, slots, length, model.device, model.dtype)
    manager = CacheManager(cache_specs(model), CacheConfig(block_size=16, num_blocks=0, num_slots=slots),
                           model.device, model.dtype, external_kv=off.layer_cache)
    return manager, off


def quality_one(model, tok, request, block: int, share: float = 0.25,
                 variant: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    from tools.workloads.scoring import score

    ids = tok.encode(request.prompt, add_bos=True)
    blocks = math.ceil(len(ids) / block)
    var = {"sink_blocks": 1, "recent_blocks": 1, "dense_layers": 0, "summary": "minmax", "per_kv_head": True,
           **(variant or {})}
    pinned = var["sink_blocks"] + var["recent_blocks"]
    budget = max(pinned + 1, math.ceil(share * blocks))
    cfg = HiSparseConfig(enabled=True, block_size=block, topk=budget - pinned, hot_blocks=budget, min_context=0, **var)
    max_new = max(8, len(tok.encode(request.answer)) + 4)
    newline = tok.encode("\n")[0]

    def runner(kind):
        if kind == "dense":
            return ModelRunner(model, dense_manager(model, 1, len(ids) + max_new + 1), cuda_graphs=False), None
        manager, off = hisparse_manager(model, cfg, 1, len(ids) + max_new + 1)
        return ModelRunner(model, manager, cuda_graphs=False), off

    def generate(kind, forced=None):
        r, _ = runner(kind)
        seq = r.cache.allocate(Sequence(kind))
        logits = [r.prefill(seq, ids)]
        out = []
        for i in range(max_new):
            nxt = forced[i] if forced is not None else int(logits[-1].argmax())
            out.append(nxt)
            if forced is None and nxt == newline:
                break
            if forced is not None and i + 1 >= len(forced):
                break
            logits.append(r.decode([seq], [nxt])[0])
        return out, logits

    dense_tokens, dense_logits = generate("dense")
    _, hs_logits = generate("hisparse", dense_tokens)
    kls, agree = [], 0
    for d, h in zip(dense_logits[1:len(dense_tokens)], hs_logits[1:len(dense_tokens)]):  # decode steps only
        lp, lq = torch.log_softmax(d.double(), -1), torch.log_softmax(h.double(), -1)
        kls.append(float((lp.exp() * (lp - lq)).sum()))
        agree += int(d.argmax() == h.argmax())
    hs_free, _ = generate("hisparse")
    return {"blocks": blocks, "resident_budget": budget, "kl": kls, "top1_agree": agree, "steps": len(kls),
            "dense_score": score(request, tok.decode(dense_tokens)), "hisparse_score": score(request, tok.decode(hs_free))}


def phase_quality(s: dict[str, Any], out: dict[str, Any]) -> None:
    from engine.tokenizer import load_tokenizer
    from tools.workloads.generate import iter_requests

    tok = load_tokenizer("byte")
    res = {}
    for preset in s["quality_presets"]:
        loaded = load_model(preset, device="cpu" if s["quick"] else s["device"], dtype=torch.float32)
        if not str(loaded.source).startswith("weights") and not s["quick"]:
            res[preset] = {"skipped": f"no trained weights under models/{preset} (source {loaded.source})"}
            continue
        per_task = {}
        for task in s["quality_tasks"]:
            overrides = dict(docs="2-3", facts_per_doc=4) if s["quick"] else {}
            rows = [quality_one(loaded.model, tok, r, s["quality_block"], s["quality_budget"], s["quality_variant"])
                    for r in iter_requests(task, s["quality_n"], seed=20, **overrides)]
            kls = [k for r in rows for k in r["kl"]]
            steps = sum(r["steps"] for r in rows)
            per_task[task] = {
                "requests": len(rows), "mean_blocks": sum(r["blocks"] for r in rows) / len(rows),
                "mean_kl": sum(kls) / len(kls) if kls else None,
                "top1_agreement": sum(r["top1_agree"] for r in rows) / steps if steps else None,
                "dense_score": sum(r["dense_score"] for r in rows) / len(rows),
                "hisparse_score": sum(r["hisparse_score"] for r in rows) / len(rows)}
            per_task[task]["delta_points"] = per_task[task]["hisparse_score"] - per_task[task]["dense_score"]
        res[preset] = {"source": loaded.source, "tasks": per_task}
    out["quality"] = res
