"""GPU check of Kimi Delta Attention (the `kda` recurrence family, engine/models/layers/kda.py)
on fla-core's kernels, whose CUDA path CI cannot run:

1. `recurrence`: fla's `chunk_kda` (one sequence and varlen), `fused_recurrent_kda` (a
   chain of one-token steps) and the dense transition through fla (S0 = I, v = 0) against
   the torch token loop (`linear_ops.naive_recurrence`), float32 inputs; the torch
   chunked form too. Max abs differences of outputs and states.
2. `model`: a tiny random Kimi-Linear-shaped model (kda, kda, MLA full, kda; dense then MoE)
   in float32: prefill logits (257 tokens) and 8 greedy decode steps with the fla backend against the
   torch backend, and PIC (fused pass, seam as wide as every segment, cold then warm) with
   the fla backend against full recompute.
3. `throughput` (GPU only): prefill time of one kda recurrence at a Kimi-Linear-48B layer's
   shape (32 heads of 128, bf16 inputs) at 4k and 16k tokens, fla `chunk_kda` against the
   torch chunked form (torch at 4k only), median of `--repeats`, synchronised.

    PYTHONPATH=. python tools/check_kda_gpu.py --json docs/results/kda-gpu.json
    PYTHONPATH=. python tools/check_kda_gpu.py --quick --json /tmp/kda.json   # CPU dry run (torch only)

The JSON is rewritten after each phase (a timeout keeps what finished); a phase that raises
records `{"error": ...}` and the next one still runs. `--quick` runs small shapes on the
CPU without fla: the fla rows read `skipped`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, small shapes, torch only (checks the script)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, metavar="PATH")
    return ap.parse_args(argv)


def _inputs(t: int, h: int, dk: int, seed: int, device, dtype=None):
    import torch
    import torch.nn.functional as F

    from engine.models.layers.linear_ops import RecurrenceInputs

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, h, dk, generator=g)
    k = F.normalize(torch.randn(1, t, h, dk, generator=g), dim=-1)
    v = torch.randn(1, t, h, dk, generator=g)
    log_decay = F.logsigmoid(torch.randn(1, t, h, dk, generator=g) + 3.0)
    beta = torch.rand(1, t, h, generator=g)
    dt = dtype or torch.float32
    return RecurrenceInputs(q=q.to(device, dt), k=k.to(device, dt), v=v.to(device, dt),
                            log_decay=log_decay.to(device), beta=beta.to(device), scale=dk ** -0.5)


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def phase_recurrence(device, fla: bool, quick: bool) -> dict:
    import torch

    from engine.models.layers import fla_backend
    from engine.models.layers.linear_ops import chunked_recurrence, naive_recurrence, transition_operator

    t, h, dk = (40, 2, 16) if quick else (300, 4, 64)
    inp = _inputs(t, h, dk, 0, device)
    s0 = torch.randn(1, h, dk, dk, generator=torch.Generator().manual_seed(1)).to(device)
    o_ref, s_ref = naive_recurrence("kda", inp, s0)
    o_c, s_c = chunked_recurrence("kda", inp, s0, 64)
    out = {"shape": {"T": t, "H": h, "dk": dk}, "torch_chunked": {"o": _err(o_c, o_ref), "state": _err(s_c, s_ref)}}
    if not fla:
        out["fla"] = "skipped (no CUDA or no fla.ops.kda)"
        return out
    o_f, s_f = fla_backend.fla_chunk("kda", inp, s0)
    out["fla_chunk"] = {"o": _err(o_f, o_ref), "state": _err(s_f, s_ref)}
    a = t // 3
    cu = torch.tensor([0, a, t], dtype=torch.long)
    starts = torch.stack([s0[0], torch.zeros_like(s0[0])])
    o_v, s_v = fla_backend.fla_chunk("kda", inp, starts, cu_seqlens=cu)
    o1, s1 = naive_recurrence("kda", inp.slice_time(0, a), s0)
    o2, s2 = naive_recurrence("kda", inp.slice_time(a, t), None)
    out["fla_chunk_varlen"] = {"o": max(_err(o_v[:, :a], o1), _err(o_v[:, a:], o2)),
                               "state": max(_err(s_v[0], s1[0]), _err(s_v[1], s2[0]))}
    s, errs = s0, []
    for i in range(min(t, 64)):
        o_i, s = fla_backend.fla_recurrent("kda", inp.slice_time(i, i + 1), s)
        errs.append(_err(o_i, naive_recurrence("kda", inp.slice_time(0, i + 1), s0)[0][:, i:i + 1]))
    out["fla_recurrent_steps"] = {"steps": len(errs), "o": max(errs),
                                  "state": _err(s, naive_recurrence("kda", inp.slice_time(0, len(errs)), s0)[1])}
    eye = torch.eye(dk, device=device).expand(1, h, dk, dk).contiguous()
    from dataclasses import replace
    probe = replace(inp, v=torch.zeros_like(inp.v))
    out["fla_transition"] = _err(fla_backend.fla_chunk("kda", probe, eye)[1], transition_operator("kda", inp))
    return out


def tiny_kimi_config(hidden: int = 128):
    from engine.models.config import DENSE, FULL, KDA, MOE, AttentionConfig, LinearConfig, ModelConfig, MoEConfig

    return ModelConfig(
        name="kimi-linear-check", family="kimi_linear", scale="custom", vocab_size=260, hidden_size=hidden,
        intermediate_size=2 * hidden, layers=(KDA, KDA, FULL, KDA), tie_embeddings=False, rms_norm_eps=1e-5,
        attention=AttentionConfig(num_heads=4, num_kv_heads=4, head_dim=48, rotary_dim=0, query_scale=48.0,
                                  mla_kv_lora_rank=32, mla_nope_dim=32, mla_rope_dim=16, mla_v_dim=32),
        linear=LinearConfig(num_heads=4, num_v_heads=4, key_dim=32, value_dim=32, conv_size=4, conv_kinds=(KDA,)),
        mlp_layers=(DENSE, MOE, MOE, MOE),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, shared_intermediate_size=64, scoring="sigmoid",
                      expert_bias=True, num_groups=4, topk_groups=2, routed_scaling_factor=2.446))


def phase_model(device, fla: bool, quick: bool) -> dict:
    import torch

    from engine.cache.manager import CacheConfig, CacheManager
    from engine.models.weights import build_model
    from engine.pic.config import PicConfig
    from engine.pic.offline import build_request, prefill_with_plan, release
    from engine.pic.planner import make_planner
    from engine.runtime.runner import ModelRunner
    from engine.runtime.sequence import Sequence
    from engine.tokenizer import load_tokenizer

    model = build_model(tiny_kimi_config(64 if quick else 128), device, torch.float32, seed=0)
    steps = 3 if quick else 8
    backends = ["torch"] + (["fla"] if fla else [])

    def runner(backend):
        cache = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=256, num_slots=2))
        return ModelRunner(model, cache, backend=backend, cuda_graphs=False)

    runners = {b: runner(b) for b in backends}
    ids = torch.randint(0, 256, (37 if quick else 257,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {}
    with torch.no_grad():
        for b, r in runners.items():
            seq = r.cache.allocate(Sequence(f"m-{b}"))
            logits = [r.prefill(seq, ids, all_logits=True)]
            nxt = int(logits[0][-1].argmax())
            for _ in range(steps):
                logits.append(r.decode([seq], [nxt]))
                nxt = int(logits[-1][0].argmax())
            r.cache.free(seq)
            runs[b] = logits
    out = {"logit_abs_max": float(runs["torch"][0].abs().max())}
    if fla:
        out["fla_vs_torch_prefill"] = _err(runs["fla"][0], runs["torch"][0])
        out["fla_vs_torch_decode"] = max(_err(a, b) for a, b in zip(runs["fla"][1:], runs["torch"][1:]))
    tok = load_tokenizer("byte")
    docs = [f"document {i}: " + "kimi delta attention " * ((1 if quick else 3) + i) for i in range(3)]
    backend = "fla" if fla else "torch"
    r = runners[backend]
    seam = max(len(tok.encode(d)) for d in docs)
    planner = make_planner(PicConfig(method="pic", seam=seam, fused=True, miss_path="alone"), model, "kda-check", tok)
    errs = []
    with torch.no_grad():
        for n, order in enumerate([(0, 1, 2), (0, 2, 1)]):
            request = build_request(tok, [{"text": docs[i], "cache": True} for i in order]
                                    + [{"text": "question?", "cache": False}], f"pic{n}")
            got = prefill_with_plan(planner, r, request)
            pic = got.logits[-1]
            prompt = list(request.prompt_token_ids)
            release(planner, r, request)
            seq = r.cache.allocate(Sequence(f"full{n}"))
            full = r.prefill(seq, prompt)
            r.cache.free(seq)
            errs.append(_err(pic, full.reshape(-1, full.shape[-1])[-1]))
    out[f"pic_whole_seam_vs_full_{backend}"] = max(errs)
    return out


def phase_throughput(device, repeats: int) -> dict:
    import torch

    from engine.models.layers import fla_backend
    from engine.models.layers.linear_ops import chunked_recurrence

    out = {}
    for t in (4096, 16384):
        inp = _inputs(t, 32, 128, 3, device, torch.bfloat16)
        row = {}
        for name, fn in (("fla_chunk_kda", lambda: fla_backend.fla_chunk("kda", inp, None)),
                         ("torch_chunked", lambda: chunked_recurrence("kda", inp, None, 64))):
            if name == "torch_chunked" and t > 4096:
                continue
            fn()
            torch.cuda.synchronize(device)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            row[name] = {"ms": ms, "tokens_per_s": t / ms * 1e3}
        out[str(t)] = row
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from engine.models.layers import fla_backend

    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    fla = device.type == "cuda" and fla_backend.fla_has_kda()
    result: dict = {"device": str(device), "fla_kda": fla, "quick": args.quick}

    def write():
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    phases = [("recurrence", lambda: phase_recurrence(device, fla, args.quick)),
              ("model", lambda: phase_model(device, fla, args.quick))]
    if device.type == "cuda" and fla and not args.quick:
        phases.append(("throughput", lambda: phase_throughput(device, args.repeats)))
    write()
    for name, run in phases:
        try:
            result[name] = run()
        except Exception as e:  # keep the other phases' figures; the error is the finding
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        write()
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
