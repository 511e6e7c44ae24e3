"""How far PIC's caches drift from full recomputation, per layer, on segmented prompts.

For each preset (trained weights under models/<preset>/ when present, else its seeded
initialisation: the tool says which) and each method (naive addition, PIC with several
seams), every request of a workload is prefilled twice: by full recomputation and by
the method (cold signature cache: misses are computed alone and spliced, which is the
same path as a hit). Reported, averaged over the requests:

- per linear layer: the relative error ||S - S_full|| / ||S_full|| of the recurrent state
  after the whole prompt, and its angle (degrees, from the cosine of the flattened
  states). At the first linear layer PIC's composition is exact (inputs are identical
  there); deeper layers receive inputs computed without the other segments, and drift;
- on the question tokens: mean KL(full || method) of the next-token distributions and
  top-1 agreement with full recomputation (what the quality harness scores in depth).

    PYTHONPATH=. python tools/pic_drift.py [--presets qwen3next-tiny,...] [--task twohop]
        [--requests 4] [--seams 0,8,16,32] [--device cpu] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

import torch

from engine.cache.layer_caches import StateSlotCache
from engine.cache.manager import CacheConfig, CacheManager
from engine.models.weights import load_model
from engine.pic.config import PicConfig
from engine.pic.offline import build_request, prefill_with_plan, release
from engine.pic.planner import make_planner
from engine.runtime.runner import ModelRunner
from engine.tokenizer import load_tokenizer

DEFAULT_PRESETS = ("qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny", "gla-tiny")


def layer_states(runner: ModelRunner, seq) -> dict[int, torch.Tensor]:
    return {i: c.state[seq.slot].clone() for i, c in enumerate(runner.cache.layers) if isinstance(c, StateSlotCache)}


def state_drift(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, ref = a.double().flatten(), ref.double().flatten()
    rel = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    cos = (a @ ref / (a.norm() * ref.norm()).clamp_min(1e-30)).clamp(-1, 1).item()
    return rel, math.degrees(math.acos(cos))


def question_fidelity(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || logits) in nats and top-1 agreement over matching rows."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == logits.argmax(-1)).double().mean().item()
    return kl, top1


def measure_preset(preset: str, task: str, n: int, seams: list[int], device: str, seed: int) -> dict:
    from tools.workloads import iter_requests

    loaded = load_model(preset, device=device)
    model, cfg = loaded.model, loaded.config
    tokenizer = load_tokenizer("byte")
    requests = list(iter_requests(task, n, seed))
    total = max(len(tokenizer.encode(r.prompt, add_bos=True)) for r in requests)
    manager = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=total // 16 + 4, num_slots=2))
    runner = ModelRunner(model, manager)
    methods = [("naive", 0)] + [("pic", s) for s in seams]
    full_planner = make_planner(PicConfig(method="full"), model, loaded.fingerprint, tokenizer)
    planners = {m: make_planner(PicConfig(method=m[0], seam=m[1], miss_path="alone"), model, loaded.fingerprint, tokenizer)
                for m in methods}
    sums: dict = {m: {"layers": {}, "kl": 0.0, "top1": 0.0} for m in methods}
    for r in requests:
        segs = [s.to_dict() for s in r.segments]
        ref = prefill_with_plan(full_planner, runner, build_request(tokenizer, segs))
        ref_states = layer_states(runner, ref.seq)
        q_start = ref.request.segments[-1].token_start
        ref_q = ref.logits[q_start - ref.logits_start:]
        release(full_planner, runner, ref.request)
        for m in methods:
            got = prefill_with_plan(planners[m], runner, build_request(tokenizer, segs))
            for i, s in layer_states(runner, got.seq).items():
                rel, ang = state_drift(s, ref_states[i])
                acc = sums[m]["layers"].setdefault(i, [0.0, 0.0])
                acc[0] += rel
                acc[1] += ang
            kl, top1 = question_fidelity(got.logits[q_start - got.logits_start:], ref_q)
            sums[m]["kl"] += kl
            sums[m]["top1"] += top1
            release(planners[m], runner, got.request)
    rows = []
    for (method, seam), acc in sums.items():
        layers = {i: {"kind": cfg.layers[i], "rel": v[0] / n, "angle_deg": v[1] / n}
                  for i, v in sorted(acc["layers"].items())}
        rows.append({"method": method, "seam": planners[(method, seam)].seam, "layers": layers,
                     "kl": acc["kl"] / n, "top1": acc["top1"] / n})
    return {"preset": preset, "weights": loaded.source, "task": task, "requests": n, "rows": rows}


def format_result(res: dict) -> str:
    lines = [f"{res['preset']} ({res['weights']}), {res['requests']} {res['task']} requests"]
    first = res["rows"][0]["layers"]
    if first:
        idx = list(first)
        lines.append("| method | seam | " + " | ".join(f"L{i} {first[i]['kind']} rel / deg" for i in idx)
                     + " | KL (nats) | top-1 |")
        lines.append("|---|---|" + "---|" * len(idx) + "---|---|")
    else:
        lines.append("| method | seam | KL (nats) | top-1 |")
        lines.append("|---|---|---|---|")
    for row in res["rows"]:
        cells = [f"{row['layers'][i]['rel']:.2e} / {row['layers'][i]['angle_deg']:.2f}" for i in row["layers"]]
        lines.append(f"| {row['method']} | {row['seam']} | " + " | ".join(cells + [f"{row['kl']:.2e}",
                                                                                 f"{row['top1']:.3f}"]) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    p.add_argument("--task", default="twohop")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--seams", default="0,8,16,32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    seams = [int(s) for s in a.seams.split(",") if s]
    results = [measure_preset(name, a.task, a.requests, seams, a.device, a.seed) for name in a.presets.split(",")]
    if a.json:
        print(json.dumps(results))
    else:
        print("\n\n".join(format_result(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
