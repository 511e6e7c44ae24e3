"""Serving benchmark: position-independent caching through the kvstore daemon against
prefix caching and full recomputation, on segmented workloads.

    python tools/bench_serving.py --json                 # on a GPU: two bench presets
    python tools/bench_serving.py --quick --json PATH    # CPU, tiny presets, ~1 minute

One run per configuration; for each preset (default qwen3next-bench, gated DeltaNet, and
ring-bench, scalar decay; `--quick`: their tiny versions) on one engine:

1. TTFT p50/p99 per workload (fact, twohop, aggregate, fewshot, rag: tools/workloads at
   bench scale; rag is the long production-RAG-like one; repeat: exact repeats, and
   chat: multi-turn chat, prefix caching's own cases; mix: all seven interleaved;
   tools/servebench/requests.py) for full recompute, prefix caching and PIC through the
   daemon, cold and warm (tools/servebench/measure.py says exactly what cold and warm
   mean), the TTFT reduction of PIC over both, and the share of the prompt prefix
   caching reused per workload (`prefix_reuse`);
2. sustainable QPS at a TTFT SLO (p99 under `--slo-ms`, default `--slo-factor` x the
   full-recompute p99 TTFT of rag on the idle engine, `--slo-of p99`: a bound the
   baseline itself meets without load; a p50-based SLO is exceeded by the idle
   baseline's own p99, so the search degenerates into noise at its lowest rate) with
   Poisson arrivals, PIC vs prefix caching;
3. two engine processes sharing one daemon vs each with a private cache: hit rate, TTFT
   per workload (`--share-tasks`), sustainable QPS over both engines on a ladder of
   Poisson rates (`--share-qps-rates`), and the loads by path (daemon tier; GPU tier on
   another GPU through CUDA IPC), bytes and time per path; with `--gpus` (automatic with
   two or more CUDA devices) each worker engine runs on its own GPU;
4. where the TTFT of a PIC hit goes, per tier: lookup, load, compose, seam, suffix;
5. parallel cold prefill: the cold TTFT of rag requests (several cold segments each) on
   one engine alone vs helped by a second, idle engine that computes some of their
   segments (engine.connector.coldshare), as a speedup (mean alone / mean helped).

It starts its own daemon (kvstore.testing.DaemonProcess, capacities from the options)
unless `--socket` names a running one. The table prints last; `--json [PATH]` writes
the whole run to PATH (default docs/results/serving-<date>.json) with `summary`
(tools/servebench/report.py). Sizing for the ~8-minute GPU run: `--n` requests per
workload (5), workloads capped by `--max-tokens` (none: bench-scale lengths, ~5.5k
tokens, rag ~13k), QPS search over `--qps-trials` (4) trials of `--qps-requests` (8)
requests, `--share-requests` (6) requests in the sharing experiment, `--cold-requests`
(4) in the cold-prefill one. `--quick` runs both two-engine experiments for its first
preset only.

`--merge RUN.json ...` joins runs made as separate processes (e.g. one preset per GPU, or
the two-GPU phases apart from the single-GPU ones, to stay inside a time limit) into one
run: presets side by side (a preset in several runs gets the union of their workloads
and phases), the summary recomputed over all of them, the command lines kept; with
`--json PATH` it is written there, and the tables print.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.connector.settings import PicSettings, PicSettingsError  # noqa: E402 (after the path fix)
from tools.results import merge_presets, read_runs, write_json  # noqa: E402

GPU_PRESETS = "qwen3next-bench,ring-bench"
QUICK_PRESETS = "qwen3next-tiny,ring-tiny"
#: the PIC defaults every entry point shares (engine.connector.settings); the flags below start there
DEFAULTS = PicSettings().pic


def pic_settings(args: argparse.Namespace) -> PicSettings:
    """The benchmark's settings: PicSettings() changed by its PIC experiment flags."""
    return PicSettings().with_pic(cold_full_fraction=args.cold_full_fraction or None,
                                  cold_full_policy=args.cold_full_policy, seam_chain=args.seam_chain,
                                  miss_path=args.miss_path, miss_signatures=args.miss_signatures,
                                  idle_resume=args.idle_resume == "on",
                                  batch_long_ranges=args.long_ranges == "batched")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, tiny presets and sizes (~1 minute)")
    ap.add_argument("--presets", default=None, help=f"comma-separated (default {GPU_PRESETS}; quick {QUICK_PRESETS})")
    ap.add_argument("--workloads", default="fact,twohop,aggregate,fewshot,rag,repeat,chat,mix",
                    help="the five document workloads, exact repeats (repeat), multi-turn chat (chat) and all "
                         "seven interleaved (mix); tools/servebench/requests.py")
    ap.add_argument("--n", type=int, default=None, help="requests per workload (default 5; quick 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on prompt + answer tokens (default none; quick 450)")
    ap.add_argument("--docs", default=None, help="documents per request MIN-MAX (default: the workload's; quick 2-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ms", type=float, default=None, help="TTFT SLO (p99) for the QPS search")
    ap.add_argument("--slo-factor", type=float, default=2.0,
                    help="SLO = factor x the idle full-recompute rag TTFT percentile --slo-of")
    ap.add_argument("--slo-of", default="p99", choices=("p50", "p99"),
                    help="the idle full-recompute rag TTFT percentile the SLO is a multiple of")
    ap.add_argument("--qps-trials", type=int, default=None, help="rates tried per method (default 4; quick 3)")
    ap.add_argument("--qps-requests", type=int, default=None, help="requests per rate (default 8; quick 4)")
    ap.add_argument("--qps-trial-s", type=float, default=None,
                    help="seconds of arrivals per QPS trial (rate x this requests, at least --qps-requests, at "
                         "most --qps-max-per-trial; a trial sure to miss the SLO is cut short); default 8 x the SLO. "
                         "0: trials of --qps-requests requests (the old search: a method whose requests fit in the "
                         "SLO back to back passes any rate)")
    ap.add_argument("--qps-max-per-trial", type=int, default=None,
                    help="requests per QPS trial at most (default 300; quick 8)")
    ap.add_argument("--qps-cache", default="both", choices=("stream", "warm", "both"),
                    help="QPS cache state (tools.servebench.measure): stream (a cold start on the pool: what the "
                         "warm-up and earlier trials left), warm (each trial's segments cached first through its "
                         "requests' twins, as in the TTFT phase's warm state), or both (default)")
    ap.add_argument("--qps-warmup", type=int, default=None,
                    help="requests of the same Zipf stream run before the QPS trials, so the caches reach a steady "
                         "state and every kernel variant is compiled (default 2 x --qps-requests)")
    ap.add_argument("--share-tasks", default="fact,twohop,aggregate,fewshot,rag",
                    help="workloads whose requests the two engines of the sharing experiment run (each "
                         "--share-requests requests, dealt alternately)")
    ap.add_argument("--share-qps-rates", default="auto",
                    help="total Poisson rates (both engines) of the two-engine QPS ladder, e.g. 2,4,8; auto (see "
                         "share_qps_rates); none: no ladder")
    ap.add_argument("--share-requests", type=int, default=None,
                    help="sharing experiment requests (default 6; quick 4, first preset only)")
    ap.add_argument("--cold-requests", type=int, default=None,
                    help="parallel cold-prefill requests (default 4; quick 2, first preset only)")
    ap.add_argument("--cold-docs", default=None,
                    help="documents per cold-prefill request MIN-MAX (default: the workload's; quick 4-5)")
    ap.add_argument("--gpus", default="auto",
                    help="GPUs of the two-engine experiments, e.g. 0,1 (worker i on the i-th); auto: the first two "
                         "when CUDA has >= 2 devices; none: the engine's device")
    ap.add_argument("--cold-full-fraction", type=float, default=DEFAULTS.cold_full_fraction or 0.0,
                    help="PIC's cold fallback (PicConfig.cold_full_fraction) in the TTFT, QPS and breakdown phases: "
                         "requests whose uncached segments hold at least this share of the prompt are prefilled by "
                         "full recompute and their segments computed while idle; 0 (the default, off) turns it off "
                         "(the two-engine phases always run without it: they measure cold PIC itself)")
    ap.add_argument("--cold-full-policy", default=DEFAULTS.cold_full_policy, choices=("fraction", "cost"),
                    help="PicConfig.cold_full_policy: fraction (fall back at --cold-full-fraction) or cost (at the "
                         "measured break-even share, full / alone cost per token, capped by the fraction)")
    ap.add_argument("--idle-resume", default="on" if DEFAULTS.idle_resume else "off", choices=("on", "off"),
                    help="PicConfig.idle_resume: an idle alone pass that gives way to a request is resumed later (on) "
                         "or dropped and queued again (off; for A/B runs)")
    ap.add_argument("--long-ranges", default="batched" if DEFAULTS.batch_long_ranges else "per-range",
                    choices=("batched", "per-range"),
                    help="PicConfig.batch_long_ranges of every PIC planner, the workers' too: a delta-rule layer's "
                         "long in-context ranges share two varlen calls (batched: the default) or take one fla call "
                         "each (per-range)")
    ap.add_argument("--share-warm-pair", default="auto", choices=("auto", "on", "off"),
                    help="run an untimed pair of workers (one request per workload and one Poisson rung) before "
                         "the measured pairs, so neither pays first-time kernel compilation; auto: on CUDA")
    ap.add_argument("--miss-path", default=DEFAULTS.miss_path, choices=("alone", "context"),
                    help="PicConfig.miss_path in the TTFT, QPS, breakdown and two-engine sharing phases: compute "
                         "a request's uncached segments alone in the request (alone) or in context in its fused "
                         "pass, alone later when idle (context); the parallel-cold phase always computes them alone "
                         "(it measures alone passes split across engines)")
    ap.add_argument("--miss-signatures", default=DEFAULTS.miss_signatures, choices=("alone", "context"),
                    help="PicConfig.miss_signatures wherever --miss-path applies (needs --miss-path context for "
                         "context): the signature of a miss computed in context comes from an idle alone pass "
                         "(alone) or from the request's own pass, kept after its first token, with no idle alone pass "
                         "(context)")
    ap.add_argument("--seam-chain", default=DEFAULTS.seam_chain, choices=("auto", "on", "off"),
                    help="PicConfig.seam_chain of PIC in this engine: auto runs scalar/diagonal-decay layers "
                         "through kernels.seam_chain on CUDA; on: every linear family (the delta rule too); off: none")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="profile the last request of each method and cache state per workload (torch.profiler: "
                         "Chrome traces and op tables in DIR)")
    ap.add_argument("--qps-trace-trial", type=int, default=None, metavar="N",
                    help="with --trace: profile stream trial N (0-based) of each method in the QPS search "
                         "(torch.profiler over every thread: requests, idle alone passes, puts)")
    ap.add_argument("--qps-idle", default="on", choices=("on", "off"),
                    help="run the engine's idle work (queued alone passes, their puts) between Poisson arrivals "
                         "(on, as a server does); off: a diagnostic, requests without background work (misses "
                         "computed in context are then never cached)")
    ap.add_argument("--put-tier", default=None, choices=("gpu", "cpu", "nvme"),
                    help="daemon tier the engines put new signatures in (default: the daemon's default tier); "
                         "gpu: the daemon's GPU tier, which engines on other GPUs read by peer copy")
    ap.add_argument("--skip", default="", help="phases to skip: qps,sharing,breakdown,cold")
    ap.add_argument("--socket", default=None, help="use the kvstore daemon at this socket (default: start one)")
    ap.add_argument("--cpu-capacity", default=None, help="daemon CPU tier (default 32GiB; quick 512MiB)")
    ap.add_argument("--gpu-capacity", default=None, help="daemon GPU tier (default 16GiB with CUDA, else 0)")
    ap.add_argument("--nvme-capacity", default=None, help="daemon NVMe tier (default 40GiB; quick 1GiB)")
    ap.add_argument("--device", default=None, help="engine device (default auto; quick cpu)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="RUN",
                    help="join these run JSONs into one (module docstring); nothing is measured")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                    help="write the run as JSON (default path docs/results/serving-<date>.json)")
    args = ap.parse_args(argv)
    q = args.quick
    args.presets = [p for p in (args.presets or (QUICK_PRESETS if q else GPU_PRESETS)).split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.skip = {s for s in args.skip.split(",") if s}
    if args.miss_signatures == "context" and args.miss_path != "context":
        ap.error("--miss-signatures context takes a miss's signature from the request's own pass, where only "
                 f"--miss-path context computes it (got --miss-path {args.miss_path})")
    try:
        pic_settings(args)
    except PicSettingsError as exc:
        ap.error(str(exc))
    args.share_tasks = [t for t in args.share_tasks.split(",") if t]
    from tools.servebench.requests import ALL_TASKS, TASKS

    unknown = [w for w in args.workloads if w not in ALL_TASKS]
    if unknown:
        ap.error(f"--workloads: {unknown}; choose from {', '.join(ALL_TASKS)}")
    bad = [t for t in args.share_tasks if t not in TASKS]
    if bad or not args.share_tasks:
        ap.error(f"--share-tasks: {bad or 'none given'}; choose from {', '.join(TASKS)}")
    if args.share_qps_rates == "none":
        args.share_qps_rates = []
    elif args.share_qps_rates != "auto":
        try:
            args.share_qps_rates = [float(x) for x in args.share_qps_rates.split(",") if x]
        except ValueError:
            ap.error(f"--share-qps-rates {args.share_qps_rates!r}: comma-separated rates per second, auto or none")
        if any(r <= 0 for r in args.share_qps_rates):
            ap.error("--share-qps-rates: every rate must be > 0")
    defaults = dict(n=(2, 5), max_tokens=(450, None), docs=("2-3", None), qps_trials=(3, 4), qps_requests=(4, 8),
                    qps_max_per_trial=(8, 300), share_requests=(4, 6), cold_requests=(2, 4), cold_docs=("4-5", None), cpu_capacity=("512MiB", "32GiB"), nvme_capacity=("1GiB", "40GiB"),
                    device=("cpu", "auto"))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.qps_trial_s is not None and args.qps_trial_s < 0:
        ap.error(f"--qps-trial-s {args.qps_trial_s}: must be >= 0 (0: fixed trials of --qps-requests)")
    return args


def worker_gpus(spec: str, device) -> list[int]:
    """`--gpus` -> device indices for the two-engine experiments ([] : the engine's device)."""
    import torch

    if device.type != "cuda" or spec == "none":
        return []
    if spec == "auto":
        n = torch.cuda.device_count()
        return [0, 1] if n >= 2 else []
    try:
        gpus = [int(g) for g in spec.split(",") if g != ""]
    except ValueError:
        raise SystemExit(f"--gpus={spec!r}: expected auto, none or device indices like 0,1") from None
    bad = [g for g in gpus if not 0 <= g < torch.cuda.device_count()]
    if bad:
        raise SystemExit(f"--gpus={spec!r}: no CUDA device {bad[0]} ({torch.cuda.device_count()} visible)")
    return gpus


def engine_options(args, device) -> dict:
    if device.type == "cuda":
        return dict(device=str(device), dtype="auto", max_num_seqs=16, max_num_batched_tokens=16384,
                    prefill_chunk_size=16384, kv_cache_tokens=262144, max_model_len=32768)
    return dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=4096, prefill_chunk_size=4096,
                kv_cache_tokens=32768, max_model_len=8192)


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def share_qps_rates(args, out: dict, scale: str) -> list[float]:
    """Total arrival rates (both engines) of the two-engine QPS ladder: --share-qps-rates,
    or "auto": twice the single-engine QPS search's start rate x 1, 2, 4, 8 when that
    phase ran in this process, else 2, 4, 8, 16 (bench scale) / 1, 2 (tiny)."""
    if args.share_qps_rates != "auto":
        return args.share_qps_rates
    start = (out.get("qps") or {}).get("start_rate")
    if start:
        return [2 * start * f for f in (1, 2, 4, 8)]
    return [2.0, 4.0, 8.0, 16.0] if scale == "bench" else [1.0, 2.0]


def pair_qps(args, runs: dict) -> dict:
    """Sustainable QPS of the two engines, shared daemon vs private caches, at one SLO:
    --slo-ms, else 2 x the private pair's idle rag p99 (one request at a time per engine)."""
    from tools.servebench import sharing

    private = runs["private"]
    base = (private["tasks"].get("rag") or {}).get("ttft_ms_p99") or private["ttft_ms_p99"]
    slo = args.slo_ms or args.slo_factor * base
    q = {"slo_ms": slo, "slo_rule": f"{args.slo_ms} ms" if args.slo_ms else
         f"{args.slo_factor} x the private pair's idle rag p99", "rates": [t["rate"] for t in private["trials"][1:]]}
    for mode in ("private", "shared"):
        q[mode] = sharing.qps_at_slo(runs[mode]["trials"][1:], slo)
    p, sh = q["private"]["sustainable_qps"], q["shared"]["sustainable_qps"]
    q["gain"] = sh / p if p else None
    return q


def two_engine_phases(preset: str, args, opts: dict, socket: str, device, scale: str, out: dict, log,
                      save) -> None:
    """The phases with two engine processes (sharing, parallel cold prefill), into `out`."""
    from tools.servebench import requests, sharing

    first = not (args.quick and preset != args.presets[0])
    threads = 1 if device.type == "cpu" else None
    gpus = worker_gpus(args.gpus, device)
    # workers compile their kernels before the timed part (nothing to compile on the CPU)
    warm = None if device.type == "cpu" else {"scale": scale, "max_tokens": args.max_tokens, "docs": args.docs}
    settings = pic_settings(args).pic
    pic = {"miss_path": settings.miss_path, "miss_signatures": settings.miss_signatures,  # the workers' PicConfig fields
           "batch_long_ranges": settings.batch_long_ranges}
    if "sharing" not in args.skip and first:
        trace = [r for task in args.share_tasks
                 for r in requests.load(task, args.share_requests, args.seed + 3, scale, args.max_tokens, args.docs)]
        rates = share_qps_rates(args, out, scale)
        k = 2 * args.qps_requests  # per rung, over both engines
        stream = requests.load("rag", k * (len(rates) + 1), args.seed + 6, scale, args.max_tokens, args.docs)
        # the first trial is an untimed burst: an engine's first concurrent requests pay one-time costs
        trials = [(rate, stream[j * k:(j + 1) * k]) for j, rate in enumerate(rates[:1] + rates)] if rates else []
        warm_pair_s = None
        if args.share_warm_pair == "on" or (args.share_warm_pair == "auto" and warm is not None):
            # untimed: on a fresh machine the first pair would compile, in its timed requests,
            # what warm_kernels missed (seen in the private pair's first requests)
            primer = [r for task in args.share_tasks
                      for r in requests.load(task, 1, args.seed + 7, scale, args.max_tokens, args.docs)]
            primer_stream = requests.load("rag", k, args.seed + 8, scale, args.max_tokens, args.docs)
            warm_pair_s = sharing.run_pair(preset, opts, primer, None, threads, gpus, warm=warm,
                                           trials=[(rates[0], primer_stream)] if rates else [], seed=args.seed + 7,
                                           pic=pic)["wall_s"]
        runs = {mode: sharing.run_pair(preset, opts, trace, socket if mode == "shared" else None, threads, gpus,
                                       warm=warm, put_tier=args.put_tier if mode == "shared" else None,
                                       trials=trials, seed=args.seed, pic=pic)
                for mode in ("private", "shared")}
        out["sharing"] = {"shared": runs["shared"], "private": runs["private"], "gpus": gpus,
                          "warm_pair_s": warm_pair_s}
        if rates:
            out["sharing"]["qps"] = pair_qps(args, runs)
        log(f"{preset} sharing: hit rate shared {out['sharing']['shared']['hit_rate']:.2f}, "
            f"private {out['sharing']['private']['hit_rate']:.2f} (devices "
            f"{out['sharing']['shared']['devices']})")
        save(out)
    if "cold" not in args.skip and first:
        reqs = requests.load("rag", args.cold_requests, args.seed + 4, scale, args.max_tokens, args.cold_docs)
        c = sharing.run_cold_parallel(preset, opts, reqs, socket, threads, gpus, warm=warm, put_tier=args.put_tier)
        c["gpus"] = gpus
        out["cold_parallel"] = c
        log(f"{preset} cold prefill: alone {c['alone']['ttft_ms_mean']:.1f} ms, helped "
            f"{c['helped']['ttft_ms_mean']:.1f} ms (x{c['speedup'] or 0:.2f}; helper computed "
            f"{c['helper']['cold_helped']} segments; devices {c['devices']})")
        save(out)


def bench_preset(preset: str, args, socket: str, tiers: tuple[str, ...], log, save=lambda out: None) -> dict:
    """Every phase of one preset; `save(out)` is called after each phase with what is
    measured so far (the run JSON is rewritten then: a run stopped by a time limit keeps
    its finished phases)."""
    import torch

    from engine.builder import EngineConfig, build_engine, resolve_device
    from tools.servebench import measure, requests
    from tools.servebench.harness import Harness

    device = resolve_device(args.device)
    opts = engine_options(args, device)
    scale = "tiny" if args.quick else "bench"
    t0 = time.perf_counter()
    if not args.workloads and {"qps", "breakdown"} <= set(args.skip):
        # only the two-engine phases: their worker processes build their own engines
        out = {"preset": preset, "device": str(device), "engine": opts, "workloads": {}}
        two_engine_phases(preset, args, opts, socket, device, scale, out, log, save)
        out["wall_s"] = time.perf_counter() - t0
        return out
    engine = build_engine(preset, EngineConfig(**opts))
    settings = pic_settings(args)
    connector = replace(settings.store, socket=socket, rpc_timeout_s=30.0, load_timeout_s=60.0, inflight_wait_s=120.0,
                        put_tier=args.put_tier)
    h = Harness(engine, connector, settings.pic, trace_dir=None if args.trace is None else str(Path(args.trace) / preset))
    h.idle_between_arrivals = args.qps_idle == "on"
    out: dict = {"preset": preset, "device": str(engine.device), "engine": opts, "workloads": {}}
    try:
        measure.warm_kernels(h, scale, args.max_tokens, args.docs)
        log(f"{preset}: engine ready in {time.perf_counter() - t0:.1f} s")
        for task in args.workloads:
            reqs = requests.load(task, args.n, args.seed, scale, args.max_tokens, args.docs)
            out["workloads"][task] = measure.ttft_by_method(h, reqs, name=task)
            w = out["workloads"][task]
            log(f"{preset}/{task}: full {w['full']['warm']['ttft_ms_p50']:.1f} ms, prefix warm "
                f"{w['prefix']['warm']['ttft_ms_p50']:.1f} ms, pic warm {w['pic']['warm']['ttft_ms_p50']:.1f} ms")
            save(out)
        rag = out["workloads"].get("rag") or next(iter(out["workloads"].values()))
        if "qps" not in args.skip:
            slo = args.slo_ms or args.slo_factor * rag["full"]["warm"][f"ttft_ms_{args.slo_of}"]
            k, trials = args.qps_requests, args.qps_trials
            warm = args.qps_warmup if args.qps_warmup is not None else 2 * k
            trial_s = None if args.qps_trial_s == 0 else (args.qps_trial_s or 8 * slo / 1e3)
            most = max(k, args.qps_max_per_trial) if trial_s else k
            stream = requests.load("rag", warm + most * trials, args.seed + 1, scale, args.max_tokens, args.docs)
            q = {"slo_ms": slo, "trial_s": trial_s, "max_per_trial": most, "slo_rule": f"{args.slo_ms} ms" if args.slo_ms else
                 f"{args.slo_factor} x full-recompute rag {args.slo_of} (idle)", "idle_between_arrivals": args.qps_idle}
            # both methods start at the same rate, half of what full recompute serves back to
            # back, and double it while the SLO holds (bisecting after the first miss)
            start = 500.0 / rag["full"]["warm"]["ttft_ms_mean"]
            q["start_rate"] = start
            if args.qps_cache in ("stream", "both"):
                for method in ("prefix", "pic"):
                    q[method] = measure.qps_at_slo(h, method, stream, warm, k, trials, slo, start, args.seed,
                                                   trace_trial=args.qps_trace_trial, trial_s=trial_s,
                                                   max_per_trial=most)
                    log(f"{preset} qps {method}: {q[method]['sustainable_qps']:.2f}/s at p99 <= {slo:.0f} ms")
            if args.qps_cache in ("warm", "both"):
                q["warm"] = {}
                wstream = requests.load("rag", warm + most * trials, args.seed + 5, scale, args.max_tokens, args.docs)
                for method in ("prefix", "pic"):
                    q["warm"][method] = measure.qps_at_slo(h, method, wstream, warm, k, trials, slo, start,
                                                           args.seed + 5, warm_twins=True, trial_s=trial_s,
                                                           max_per_trial=most)
                    log(f"{preset} qps {method} (warm): {q['warm'][method]['sustainable_qps']:.2f}/s "
                        f"at p99 <= {slo:.0f} ms")
            out["qps"] = q
            save(out)
        if "breakdown" not in args.skip:
            req = requests.load("rag", 1, args.seed + 2, scale, args.max_tokens, args.docs)[0]
            h.planner("pic")
            h.run_alone(req)
            out["breakdown"] = measure.hit_breakdown(h, req, tiers)
            save(out)
        two_engine_phases(preset, args, opts, socket, device, scale, out, log, save)
        out["connector"] = h.store.metrics.snapshot()
        out["pic_costs"] = h.planner("pic").costs.snapshot()  # engine.pic.costs: alone vs full ms per token
        out["purged_objects"] = h.purge()  # room for the next preset
    finally:
        h.close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["wall_s"] = time.perf_counter() - t0
    return out


def write_run(args, argv, start: float, presets: dict, complete: bool) -> dict:
    """The run record (summary over `presets`); written to the --json path when given.
    `complete` is False while phases are still to come."""
    from tools.servebench import report

    run = {"date": dt.date.today().isoformat(), "command": " ".join(["python", "tools/bench_serving.py",
                                                                    *(argv if argv is not None else sys.argv[1:])]),
           "machine": machine(), "quick": args.quick, "config": {k: (sorted(v) if isinstance(v, set) else v)
                                                                 for k, v in vars(args).items()},
           "complete": complete, "presets": presets, "summary": report.summarize(presets),
           "wall_s": time.perf_counter() - start}
    if args.json is not None:
        path = Path(args.json) if args.json else REPO / "docs" / "results" / f"serving-{run['date']}.json"
        run["path"] = str(write_json(path, run))
    return run


def merge_runs(paths: list[str]) -> dict:
    """One run from several run JSONs (module docstring)."""
    from tools.servebench import report

    runs = read_runs(paths, "bench_serving")
    presets = merge_presets(runs)
    return {"date": runs[0].get("date"), "command": " && ".join(r.get("command", "?") for r in runs),
            "machine": runs[0].get("machine"), "quick": any(r.get("quick") for r in runs),
            "config": [r.get("config") for r in runs], "merged_from": [str(p) for p in paths],
            "presets": presets, "summary": report.summarize(presets),
            "wall_s": sum(r.get("wall_s") or 0.0 for r in runs)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        from tools.servebench import report

        run = merge_runs(args.merge)
        if args.json is not None:
            write_json(Path(args.json) if args.json else REPO / "docs" / "results" / f"serving-{run['date']}.json", run)
        print(report.tables(run["presets"], run["summary"]))
        return 0
    import torch

    from kvstore.testing import DaemonProcess
    from tools.servebench import report

    if args.quick:
        torch.set_num_threads(1)
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    daemon = None
    socket = args.socket
    cuda = torch.cuda.is_available() and args.device != "cpu"
    gpu_cap = args.gpu_capacity or ("16GiB" if cuda else "0")
    if socket is None:
        daemon = DaemonProcess(Path(tempfile.mkdtemp(prefix="bench-serving-")), cpu_capacity=args.cpu_capacity,
                               nvme_capacity=args.nvme_capacity, gpu_capacity=gpu_cap, lease_ttl=60.0,
                               entry="kvstore.server")  # the daemon without typer/rich
        daemon.start(timeout=300)
        socket = str(daemon.socket)
        log(f"daemon at {socket} (cpu {args.cpu_capacity}, gpu {gpu_cap}, nvme {args.nvme_capacity})")
    try:
        from kvstore.client import KVStoreClient

        with KVStoreClient(socket) as kv:
            tiers = kv.info.tiers
        presets: dict = {}
        for p in args.presets:
            presets[p] = bench_preset(p, args, socket, tiers, log,
                                      save=lambda out, _p=p: write_run(args, argv, start, {**presets, _p: out},
                                                                       complete=False))
    finally:
        if daemon is not None:
            daemon.cleanup()
    run = write_run(args, argv, start, presets, complete=True)
    if run.get("path"):
        log(f"wrote {run['path']}")
    summary = run["summary"]
    print(report.tables(presets, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
