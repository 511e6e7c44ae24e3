"""What a cold stream costs per request with misses' signatures from alone passes vs from
the request's own pass (PicConfig.miss_signatures, engine.pic.capture), side by side in
one process on one engine.

Both configurations compute a request's misses in context (`miss_path="context"`, the
serving default). `alone`: each miss is queued and computed by an idle-time alone pass
(`help_idle`), which is what makes it a hit for later requests. `context`: the signature
is taken from the request's pass and no alone pass runs. The stream is rag requests from
the Zipf document pool (tools.servebench.requests, a cold start: most documents new at
first, recurring later), one request at a time, each followed by the idle work it left
(drained to the end, as an engine with enough idle time between arrivals would; context
signatures are kept there too, after the request's first token: `keep_captured`). Per
request it records the TTFT, the idle work after it, and hits; the table gives means,
the work per request (TTFT + idle: what bounds a saturated engine's rate) and the
context / alone ratios. `full` and `prefix` run the same stream as baselines.

    PYTHONPATH=. python tools/bench_miss_signatures.py [--presets qwen3next-tiny,ring-tiny] [--n 40]
        [--device auto] [--scale tiny|bench] [--json docs/results/miss-signatures-<date>.json]

On the CPU only the ratios mean anything (tiny models are dominated by per-op overhead).
Prints the table last.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SOURCES = ("alone", "context")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen3next-tiny,ring-tiny")
    ap.add_argument("--n", type=int, default=40, help="rag requests in the stream (default 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", choices=("tiny", "bench"), default=None,
                    help="workload scale; default tiny on the CPU, bench on CUDA")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seam", type=int, default=16)
    ap.add_argument("--baselines", default="full,prefix", help="methods run on the same stream ('' for none)")
    ap.add_argument("--json", nargs="?", const="", default=None,
                    help="write the run (default docs/results/miss-signatures-<date>.json)")
    args = ap.parse_args(argv)
    if args.n < 2:
        ap.error(f"--n {args.n} must be >= 2")
    if args.seam < 0:
        ap.error(f"--seam {args.seam} must be >= 0")
    bad = [m for m in args.baselines.split(",") if m and m not in ("full", "prefix")]
    if bad:
        ap.error(f"--baselines: {bad[0]!r} is not one of full, prefix")
    return args


def _sync(device) -> None:
    import torch

    if device.type == "cuda":  # pragma: no cover - GPU only
        torch.cuda.synchronize(device)


def run_stream(engine, planner, stream, device) -> list[dict]:
    """Every request of `stream` alone, then the idle work it left; one record each."""
    from engine.runtime.sampling import SamplingParams

    engine.scheduler.planner = planner
    out = []
    for i, req in enumerate(stream):
        rid = f"{req.id}#{i}"
        engine.add_request(req.as_prompt(), SamplingParams(max_new_tokens=1, ignore_eos=True), request_id=rid)
        final = None
        while final is None:
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    final = o
        rep = planner.take_report(rid)
        t0 = time.perf_counter()
        kept = getattr(planner, "keep_captured", lambda: 0)()  # context signatures: kept after the first token
        idle_segments = 0
        while True:
            n = engine.help_idle()
            if not n:
                break
            idle_segments += n
        _sync(device)
        idle_ms = (time.perf_counter() - t0) * 1e3
        d = rep.as_dict() if rep is not None else {}
        out.append({"ttft_ms": final.timeline.ttft * 1e3, "idle_ms": idle_ms, "idle_segments": idle_segments,
                    "kept_after": kept,
                    "prompt_tokens": final.num_prompt_tokens, "hit_segments": d.get("hit_segments", 0),
                    "miss_segments": d.get("miss_segments", 0), "reused_tokens": d.get("reused_tokens", 0),
                    "captured_segments": d.get("captured_segments", 0)})
    return out


def summarize(records: list[dict]) -> dict:
    ttft = [r["ttft_ms"] for r in records]
    idle = [r["idle_ms"] for r in records]
    hits = sum(r["hit_segments"] for r in records)
    segs = hits + sum(r["miss_segments"] for r in records)
    return {"requests": len(records), "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_p50": statistics.median(ttft),
            "idle_ms_mean": statistics.fmean(idle), "work_ms_mean": statistics.fmean(t + i for t, i in zip(ttft, idle)),
            "hit_rate": hits / segs if segs else None,
            "reused_fraction": sum(r["reused_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records),
            "idle_segments": sum(r["idle_segments"] for r in records),
            "captured_segments": sum(r["captured_segments"] for r in records)}


def bench_preset(preset: str, args, device) -> dict:
    from engine.builder import EngineConfig, build_engine
    from engine.pic.config import PicConfig
    from engine.pic.planner import make_planner
    from tools.servebench import requests

    engine = build_engine(preset, EngineConfig(device=str(device), dtype=args.dtype))
    scale = args.scale or ("bench" if device.type == "cuda" else "tiny")
    stream = requests.load("rag", args.n, args.seed, scale)
    warm = requests.load("rag", 2, args.seed + 1000, scale)  # kernels, allocator: untimed
    fp, tok, model = engine.loaded_model.fingerprint, engine.tokenizer, engine.runner.model
    configs = {m: PicConfig(method=m) for m in args.baselines.split(",") if m}
    for src in SOURCES:
        # no exact prefixes: the idle work measured is the misses' signatures alone
        configs[f"pic-{src}"] = PicConfig(seam=args.seam, miss_path="context", miss_signatures=src, exact_prefix=False)
    out = {"preset": preset, "scale": scale, "methods": {}}
    for name, cfg in configs.items():
        run_stream(engine, make_planner(cfg, model, fp, tok), warm, device)
        planner = make_planner(cfg, model, fp, tok)  # a fresh cache: the stream is a cold start
        records = run_stream(engine, planner, stream, device)
        out["methods"][name] = {"summary": summarize(records), "requests": records}
        print(f"{preset} {name}: {out['methods'][name]['summary']}", flush=True)
    s = {k: v["summary"] for k, v in out["methods"].items()}
    a, c = s["pic-alone"], s["pic-context"]
    out["ratios"] = {
        "work_alone_over_context": a["work_ms_mean"] / c["work_ms_mean"],
        "ttft_alone_over_context": a["ttft_ms_mean"] / c["ttft_ms_mean"],
        **({"work_prefix_over_context": s["prefix"]["work_ms_mean"] / c["work_ms_mean"],
            "work_prefix_over_alone": s["prefix"]["work_ms_mean"] / a["work_ms_mean"]} if "prefix" in s else {}),
    }
    return out


def table(results: list[dict]) -> str:
    lines = ["| preset | method | TTFT mean ms | TTFT p50 ms | idle ms/req | work ms/req | hit rate | reused % | "
             "alone-pass segments | captured |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for name, m in r["methods"].items():
            s = m["summary"]
            hr = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.2f}"
            lines.append(f"| {r['preset']} | {name} | {s['ttft_ms_mean']:.1f} | {s['ttft_ms_p50']:.1f} | "
                         f"{s['idle_ms_mean']:.1f} | {s['work_ms_mean']:.1f} | {hr} | {100 * s['reused_fraction']:.0f} | "
                         f"{s['idle_segments']} | {s['captured_segments']} |")
    lines.append("")
    lines.append("| preset | work alone / context | TTFT alone / context | work prefix / context | work prefix / alone |")
    lines.append("|---|---:|---:|---:|---:|")
    for r in results:
        q = r["ratios"]
        f = lambda k: "-" if k not in q else f"{q[k]:.2f}x"  # noqa: E731
        lines.append(f"| {r['preset']} | {f('work_alone_over_context')} | {f('ttft_alone_over_context')} | "
                     f"{f('work_prefix_over_context')} | {f('work_prefix_over_alone')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from engine.builder import resolve_device

    device = resolve_device(args.device)
    results = [bench_preset(p.strip(), args, device) for p in args.presets.split(",") if p.strip()]
    run = {"date": date.today().isoformat(), "machine": platform.node(), "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "args": vars(args), "presets": results}
    if args.json is not None:
        path = Path(args.json or REPO / "docs" / "results" / f"miss-signatures-{run['date']}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run, indent=1))
        print(f"wrote {path}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
