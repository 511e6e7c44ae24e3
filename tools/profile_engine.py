"""Where an engine's time goes: one warm request per method, one decode step, profiled.

    python tools/profile_engine.py                               # on a GPU, qwen3next-bench
    python tools/profile_engine.py --preset qwen3next-tiny --device cpu --tasks fact

For each task (default fact and rag at the preset's scale) it runs full recompute,
prefix caching (warmed by the request's twin: same segments, rotated order) and PIC
over the engine's in-process signature cache (warmed by a first run), then times one
more warm run of each (TTFT and the planner's split) with the device synchronised at
every step. The last warm PIC and prefix runs are profiled twice: cProfile (host
time by function, cumulative) and torch.profiler (ops by self CPU time and by device
time, with the count of host<->device syncs). Decode at batch 1 gets the same. Tables
print to stdout; `--out DIR` also writes the profiler tables and a JSON of the times.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3next-bench")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tasks", default="fact,rag")
    ap.add_argument("--methods", default="full,prefix,pic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--decode-context", type=int, default=2048)
    ap.add_argument("--top", type=int, default=30, help="rows per profiler table")
    ap.add_argument("--no-torch-profiler", action="store_true")
    ap.add_argument("--seam-chain", default="auto", choices=("auto", "on", "off"),
                    help="PIC's linear layers: one kernels.seam_chain launch per layer (auto: on CUDA)")
    ap.add_argument("--no-fused", action="store_true", help="PIC/prefix: the step-by-step plan")
    ap.add_argument("--out", default=None, help="directory for the tables and times.json")
    return ap.parse_args(argv)


def _engine(args):
    from engine.builder import EngineConfig, build_engine, resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        opts = dict(device=str(device), dtype="auto", max_num_seqs=16, max_num_batched_tokens=16384,
                    prefill_chunk_size=16384, kv_cache_tokens=262144, max_model_len=32768)
    else:
        opts = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=4096,
                    prefill_chunk_size=4096, kv_cache_tokens=32768, max_model_len=8192)
    return build_engine(args.preset, EngineConfig(**opts))


def _sync(engine):
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def torch_tables(prof, top: int) -> str:
    """A finished torch.profiler run as text: ops by self CPU time, by self device time
    (when it recorded CUDA), and the count of host<->device sync-like calls."""
    ka = prof.key_averages()
    out = [ka.table(sort_by="self_cpu_time_total", row_limit=top)]
    try:
        out.append(ka.table(sort_by="self_cuda_time_total", row_limit=top))
    except Exception:  # noqa: BLE001 - CPU-only profile
        pass
    syncs = {e.key: e.count for e in ka if any(s in e.key for s in (
        "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense",
        "cudaMemcpy", "cudaEventSynchronize"))}
    out.append("sync-like calls: " + json.dumps(syncs))
    return "\n".join(out)


def _cprofile_table(prof: cProfile.Profile, top: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("tottime").print_stats(top)
    return s.getvalue() + "\n" + s2.getvalue()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from engine.pic.config import PicConfig
    from engine.pic.planner import make_planner
    from engine.runtime.sampling import SamplingParams
    from tools.servebench.requests import load, twin

    engine = _engine(args)
    engine.sync_timings = True
    fp = engine.loaded_model.fingerprint
    scale = "tiny" if args.preset.endswith("-tiny") else "bench"
    model = engine.runner.model
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    texts: dict[str, str] = {}
    times: dict = {"preset": args.preset, "device": str(engine.device), "runs": []}
    rid = [0]

    def run(req, max_new=1):
        rid[0] += 1
        name = f"{req.id}#{rid[0]}"
        engine.add_request(req.as_prompt(), SamplingParams(max_new_tokens=max_new, ignore_eos=True), request_id=name)
        final = None
        while final is None:
            for o in engine.step():
                if o.request_id == name and o.finished:
                    final = o
        _sync(engine)
        rep = engine.scheduler.planner.take_report(name)
        return final.timeline.ttft * 1e3, (rep.as_dict() if rep else {}), final.num_prompt_tokens

    def planner(method):
        cfg = PicConfig(method=method, seam_chain=args.seam_chain, fused=not args.no_fused,
                        miss_path="context" if not args.no_fused else "alone")
        p = make_planner(cfg, model, fp, engine.tokenizer)
        engine.scheduler.planner = p
        return p

    # warm-up: compile every kernel the methods use
    warm = load("fact", 1, args.seed + 99, scale, args.max_tokens)[0]
    for m in args.methods.split(","):
        planner(m)
        run(twin(warm))
        run(warm)
    for task in args.tasks.split(","):
        req = load(task, 1, args.seed, scale, args.max_tokens)[0]
        for m in args.methods.split(","):
            planner(m)
            if m != "full":
                cold_ms, cold_rep, cold_n = run(twin(req))  # warms prefix with the twin's first segments, pic with all
                if m == "pic":
                    times["runs"].append({"task": task, "method": "pic-cold", "prompt_tokens": cold_n,
                                          "ttft_ms": cold_ms, **{k: v for k, v in cold_rep.items()
                                                                  if k.endswith("_ms")}})
                    print(f"[{task}/pic-cold] ttft {cold_ms:.1f} ms (every segment computed alone first)", flush=True)
            ms, rep, n = run(req)  # a first warm run (prefix: tree now also holds this order)
            if m == "prefix":  # measure prefix with only the twin warm, as the serving bench does
                planner(m)
                run(twin(req))
            t0 = time.perf_counter()
            pr = cProfile.Profile()
            pr.enable()
            ms, rep, n = run(req)
            pr.disable()
            wall = (time.perf_counter() - t0) * 1e3
            row = {"task": task, "method": m, "prompt_tokens": n, "ttft_ms": ms, "wall_ms": wall,
                   **{k: v for k, v in rep.items() if k.endswith("_ms") or k.endswith("_tokens") or k.endswith("segments")}}
            times["runs"].append(row)
            print(f"[{task}/{m}] ttft {ms:.1f} ms over {n} tokens: "
                  + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                              if k not in ("task", "method")), flush=True)
            texts[f"{task}-{m}-cprofile"] = _cprofile_table(pr, args.top)
            if not args.no_torch_profiler and m != "full":
                if m == "prefix":
                    planner(m)
                    run(twin(req))
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    run(req)
                texts[f"{task}-{m}-torchprof"] = torch_tables(prof, args.top)

    # decode at batch 1
    from engine.runtime.sequence import Sequence

    runner = engine.runner
    seq = runner.cache.allocate(Sequence("decode-profile"))
    if seq.is_allocated:
        ids = torch.randint(0, model.config.vocab_size - 1, (args.decode_context,))
        runner.prefill(seq, ids)
        tok = [1]
        for _ in range(5):
            runner.decode([seq], tok)
        _sync(engine)
        t0 = time.perf_counter()
        steps = 20
        for _ in range(steps):
            runner.decode([seq], tok)
        _sync(engine)
        step_ms = (time.perf_counter() - t0) * 1e3 / steps
        times["decode_step_ms_batch1"] = step_ms
        print(f"[decode] batch 1, context {args.decode_context}: {step_ms:.2f} ms/step", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            runner.decode([seq], tok)
        _sync(engine)
        pr.disable()
        texts["decode-cprofile"] = _cprofile_table(pr, args.top)
        if not args.no_torch_profiler:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(5):
                    runner.decode([seq], tok)
                _sync(engine)
            texts["decode-torchprof"] = torch_tables(prof, args.top)
    for name, text in texts.items():
        if out_dir:
            (out_dir / f"{name}.txt").write_text(text)
    if out_dir:
        (out_dir / "times.json").write_text(json.dumps(times, indent=1))
    # the summary table last
    print("\n| task | method | tokens | TTFT ms | lookup | miss | load/compose | seam | suffix | checkpoint | one pass |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in times["runs"]:
        print(f"| {r['task']} | {r['method']} | {r.get('prompt_tokens', '')} | {r['ttft_ms']:.1f} | "
              + " | ".join(f"{r.get(k, 0.0):.1f}" for k in ("lookup_ms", "miss_ms", "load_compose_ms", "seam_ms",
                                                            "suffix_ms", "checkpoint_ms", "fused_ms")) + " |")
    if "decode_step_ms_batch1" in times:
        print(f"decode batch 1: {times['decode_step_ms_batch1']:.2f} ms/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
