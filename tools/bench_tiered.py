"""Tiered serving benchmark (issue 23): PIC against full recompute and prefix caching with
its checkpoints in the same daemon tiers, QPS at a p99 SLO by bisection over repeats, and
a working-set sweep whose corpus outgrows the GPU tier.

    python tools/bench_tiered.py --quick --json PATH    # CPU, tiny preset, every phase: ~1.5 min on 2 cores

On the H200: one command per 10-minute call, each phase under a wall-clock limit, the
JSON rewritten after every unit of work, and each command keeping the earlier phases of
the same file (`--merge` alone), so the calls add up to one run and a timeout loses at
most the unit under way:

    OUT=/root/out/serving-tiered.json
    # 1. serve + pcie: ~2 min on a box whose Triton cache is warm, ~4 min fresh
    python tools/bench_tiered.py --phases serve,pcie --n 2 --limit-s serve=360,pcie=60 --json $OUT --merge
    # 2. qps: ~2.5 min warm, ~4 min fresh
    python tools/bench_tiered.py --phases qps --qps-repeats 3 --qps-requests 6 --qps-max-trials 5 \
        --qps-warmup 2 --limit-s qps=330 --json $OUT --merge
    # 3. sweep: ~2 min warm, ~4 min fresh
    python tools/bench_tiered.py --phases sweep --sweep 0.5,2,8,32 --limit-s sweep=360 --json $OUT --merge
    # the real-shape presets' TTFT and QPS tables, one call each (a file of their own, so the
    # headline summary stays qwen3next-bench's): ~6.5 min (qwen3.5, 65 GiB bf16), ~4.5 min (ring)
    python tools/bench_tiered.py --preset qwen3.5-35b-a3b-real --phases serve,qps --n 2 --qps-repeats 3 \
        --qps-requests 6 --qps-max-trials 5 --qps-warmup 2 --limit-s serve=240,qps=240 \
        --json /root/out/serving-tiered-real.json --merge
    python tools/bench_tiered.py --preset ring-mini-linear-2.0-real --phases serve,qps --n 2 --qps-repeats 3 \
        --qps-requests 6 --qps-max-trials 5 --qps-warmup 2 --limit-s serve=240,qps=240 \
        --json /root/out/serving-tiered-real.json --merge
    # diagnostics, not for the figures (they change the TTFTs they explain): exact per-step
    # device times in the breakdowns; kernel specialisations a timed request compiled
    python tools/bench_tiered.py --phases serve --workloads repeat,chat --n 3 --sync-timings --json /root/out/sync.json
    python tools/bench_tiered.py --phases serve --n 1 --check-warmup --json /root/out/check-warmup.json

Time estimates, from the code and the 2026-12-02 H200 run (qwen3next-bench: full rag
~14k tokens 150-310 ms, warm PIC 20-40 ms, 50 KB of signature per token): every command
pays a preamble of ~30 s (imports, fla, model build, upfront prefill-graph capture,
daemon start) and, on a box whose Triton cache is cold, 60-120 s of kernel compilation in
`measure.warm_kernels` (seconds when an earlier command on the box compiled them).
- serve (`--n 2`, 8 workloads): untimed warm-up of 7 workloads x 1 request x 7 runs (full;
  prefix and PIC each cold, twin, warm) ~10 s; timed 7 x 2 x 7 runs + mix 7 x 7 ~ 100
  runs ~20-30 s with their idle exact-prefix passes and puts; break-even read-back ~2 s.
- pcie: 6 pinned 256 MiB copies (< 1 s), `--n` rag requests x 3 passes through the CPU
  tier (~2 s).
- qps: per repeat and method `--qps-warmup` requests alone, one burst, then up to
  `--qps-max-trials` trials of `--qps-requests` Poisson arrivals near the sustainable
  rate (3-10/s, a trial ~1.5-3 s with its drain): ~12 s a search with 2/6/5, ~25 s with
  the defaults 4/8/8; x 2 methods x `--qps-repeats`; alone in its process it first runs
  3 rag requests for its SLO base and warms up on rag.
- sweep (0.5,2,8,32 x a 512 MiB GPU tier): its own engine and daemon (~30 s); the corpus
  grows to 16 GiB (~190 documents of ~85 MB, ~48 cold build requests with their puts and
  ~12 GiB demoted to NVMe: ~40 s); 4 points x `--sweep-requests` (6) x (full + PIC
  loading from the tiers, <= 0.5 s) ~15 s.
- real shapes: prefill ~2.3x qwen3next-bench's per token on qwen3.5-35b-a3b-real (16k
  tokens in 0.59 s, docs/results/models-2026-12-02.json), ~0.8x on ring; the model is
  built on the device from meta-device modules (bench_models measured 0.4 s), its kernels
  compile anew (head dims differ).
Limits are cooperative: a phase past its limit finishes the unit under way (a workload
~5 s; a QPS trial ~3 s; a sweep request ~1 s) and stops, recording
`"stopped": "time limit"` (per phase in `phases`, and in `qps` / `sweep`); the untimed
warm-up (and its compilation) runs inside the first engine phase and is not cut, so give
that phase a limit above it. A run killed from outside keeps what its last rewrite held.

(the QPS phase without the serve phase in its process measures its SLO base, the idle
full-recompute rag p99, on three requests of its own first)

Warm-up (`warmup` in the JSON: seconds, and the throwaway requests' TTFTs): before any
timed request, untimed, on CUDA `measure.warm_kernels` (with the decode step of every
batch-size bucket up to max_num_seqs: the QPS phase's batched decodes), then the serve procedure itself
(tools.servebench.tiered.warm_up: full, prefix and PIC, cold and after the twin) on
`--warmup-n` throwaway requests of each timed workload's size class (mix excepted: it is
made of the others' requests; rag alone when the process runs the qps phase without the
serve phase), so no timed request pays kernel compilation (prefill-graph buckets are
captured when the engine is built: EngineConfig.prefill_graphs "upfront"). After the
warm-up, between units of work, the kernels Triton holds compiled are counted
(tools.servebench.kernel_keys.CompileCounter, no cost inside a timed request): any unit
that compiled one is listed in `warmup.compiled_after` (per serve workload, pcie, qps;
empty on the CPU, which compiles nothing) and logged. `--check-warmup` records the
specialisation key of every Triton launch and lists in `warmup.cold_launches` those a
timed request launched first, each a compilation on a GPU (tools.servebench.kernel_keys;
on the CPU it sees PIC's own kernels under TRITON_INTERPRET with `--pic-kernel triton`,
not the model's, which run as torch there; it costs host time at every launch, so it is
a diagnostic run). Each workload records its hits by source (`hits_by_source` of each
method and state: the engine's device cache, the daemon's gpu / cpu / nvme tiers, exact
prefixes restored) and the log line prints the warm ones.

Phases (`--phases`, run in this order whatever the order given; serve, pcie and qps
share one engine and daemon, whose GPU tier is sized once the model is loaded:
`--gpu-capacity`, default 16 GiB or a quarter of the free device memory, the smaller;
`phases` in the JSON: each one's limit, wall time, `stopped` and `complete`):

- `serve`: TTFT per workload (the five document workloads, `repeat`, `chat`, `mix`:
  tools/servebench/requests.py), cold and warm (tools.servebench.tiered.ttft_after_twin:
  warm = after the request's twin only, for both caching methods alike), for full
  recompute, prefix caching through the daemon (`--method prefix --store`: its
  checkpoints in the daemon's tiers, its tree bounded like PIC's exact prefixes) and PIC
  through the daemon, with the engine's device cache bounded by
  `--device-cache-fraction` of the free device memory (StoreConnectorConfig). Every
  warm request of prefix caching and PIC records where its TTFT went (`breakdown`:
  lookup, restore, miss, forward, drain, other ms and the daemon calls it made;
  tools.servebench.breakdown), the log prints the means for repeat and chat.
- `pcie`: pinned host -> device bandwidth (`pcie.pinned_h2d_gbps`; None without CUDA),
  then the serving path's CPU-tier loads (`cpu_tier_step`, below).
- `qps`: sustainable Poisson rate at p99 TTFT <= SLO (`--slo-factor` x the idle
  full-recompute rag p99 of the serve phase, or `--slo-ms`), found by bracketing and
  bisection to within `--qps-tolerance` (10%), `--qps-repeats` (3) times per method
  (prefix caching through the daemon, PIC), on fresh rag requests (tools/servebench/tiered.py).
- `sweep`: a document corpus whose signatures occupy `--sweep` (0.5,2,8,32) times the GPU
  tier, in a daemon of its own (GPU tier `--sweep-gpu-tier`, puts into it, evictions
  demoting to CPU then NVMe); without CUDA the daemon's CPU tier stands in for the GPU
  tier (recorded as `gpu_tier_stand_in: "cpu"`). The engine's device cache and exact
  prefixes are off there: every hit comes from a daemon tier (hits, bytes and time per
  tier, device memory; tools/servebench/tiered.py).

Also measured, in the serve phase: per preset the break-even disk bandwidth of a hit.
`summary` (issue 23's names): `ttft_vs_best_baseline_avg` / `_min` (warm TTFT of the
faster baseline / PIC's, over workloads), `exact_repeat_pic_over_prefix_ttft` (PIC /
prefix caching warm TTFT on `repeat`), `qps_gain_vs_prefix_at_slo_median` (median over
repeats of PIC / prefix sustainable rate), `qps_repeats` (each repeat's rates and gain),
`cpu_to_gpu_fraction_of_pcie_serving` (CPU-tier -> device copies of the PIC planners in
this run, bytes / copy time, over the pinned H2D bandwidth of the pcie phase; None
without CUDA). In the serve phase the engine's device cache and the daemon's GPU tier
hold every warm hit, so the pcie phase has a measured step of its own (`cpu_tier_step`,
tools.servebench.tiered.cpu_tier_loads: its rag requests once more with the device cache
off and puts into the CPU tier, so every hit loads from the CPU tier); the sweep's
CPU-tier loads (points past 1x, where the GPU tier overflows) count too.
`summary.cpu_to_gpu_serving` says which: `source` (the phases whose copies make the
figure), `by_phase` (bytes, ms and GB/s of each). `working_set_sweep` (the sweep's
points), `break_even_read_gb_per_s` (per preset).

`--merge` alone keeps, in the `--json` file it rewrites, the earlier runs' results this
run does not measure (per preset: each workload, each key, each phase's record; this
run's replace theirs), so the summary is computed over every phase present.
`--merge RUN.json ...` joins runs (phases or presets from separate processes) into one
and recomputes the summary (the first run that has a key wins); with `--json PATH` it is
written there (default docs/results/serving-tiered-<date>.json).

Real-shape presets (`--preset qwen3.5-35b-a3b-real` / `ring-mini-linear-2.0-real`,
engine/models/published.py): on the GPU the model is built in bf16 on the device (no
host or float32 copy, engine.models.weights.build_model), one engine at a time (the
sweep's is built after the first is freed), the device cache and the daemon's GPU tier
sized from the memory left; with `--quick` the scaled-down variant runs on the CPU
(tools.bench_models.scaled_down: the same layer families and routing), `model` in the
JSON names it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tools.results import merge_presets, read_runs, write_json  # noqa: E402
from tools.servebench.phase_clock import PhaseClock, parse_limits  # noqa: E402

#: the phases, in the order a command runs them (serve, pcie and qps share one engine and daemon)
PHASES = ("serve", "pcie", "qps", "sweep")
ENGINE_PHASES = ("serve", "pcie", "qps")
WORKLOADS = "fact,twohop,aggregate,fewshot,rag,repeat,chat,mix"


def _size(text: str) -> int:
    from kvstore.config import parse_size

    return parse_size(text)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, tiny preset and sizes")
    ap.add_argument("--preset", default=None,
                    help="model preset (default qwen3next-bench; quick qwen3next-tiny); a real-shape preset "
                         "(qwen3.5-35b-a3b-real, ring-mini-linear-2.0-real) runs with --quick as its scaled-down "
                         "variant (tools.bench_models.scaled_down)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    ap.add_argument("--limit-s", default=None, metavar="LIMITS",
                    help="wall-clock limit per phase: SECONDS (each phase) or PHASE=SECONDS,... (e.g. "
                         "serve=300,qps=200); a phase past it stops after its current unit of work and records "
                         "\"stopped\": \"time limit\"")
    ap.add_argument("--sync-timings", action="store_true",
                    help="diagnostic: synchronise the device at every prefill step (exact per-step device times in "
                         "each request's breakdown; the TTFTs include the syncs)")
    ap.add_argument("--check-warmup", action="store_true",
                    help="record every kernel specialisation launched (tools.servebench.kernel_keys) and list those a "
                         "timed request launched first (warmup.cold_launches)")
    ap.add_argument("--workloads", default=WORKLOADS, help="workloads of the serve phase")
    ap.add_argument("--n", type=int, default=None, help="requests per workload (default 5; quick 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on prompt + answer tokens (quick 450)")
    ap.add_argument("--docs", default=None, help="documents per request MIN-MAX (quick 2-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-n", type=int, default=1,
                    help="untimed requests per workload before the timed ones (compiles their kernel shapes)")
    ap.add_argument("--device-cache-fraction", type=float, default=None,
                    help="StoreConnectorConfig.device_cache_fraction of the serve and qps phases (default: the "
                         "connector's default, 0.05 of free memory on CUDA, none on the CPU)")
    ap.add_argument("--slo-ms", type=float, default=None, help="p99 TTFT SLO of the QPS search")
    ap.add_argument("--slo-factor", type=float, default=2.0, help="SLO = factor x idle full-recompute rag p99")
    ap.add_argument("--qps-repeats", type=int, default=3)
    ap.add_argument("--qps-tolerance", type=float, default=0.1, help="bisection stops within this share")
    ap.add_argument("--qps-requests", type=int, default=None, help="requests per trial (default 8; quick 3)")
    ap.add_argument("--qps-max-trials", type=int, default=None, help="trials per search (default 8; quick 6)")
    ap.add_argument("--qps-warmup", type=int, default=None, help="untimed requests before each search (default 4; "
                                                                  "quick 1)")
    ap.add_argument("--sweep", default="0.5,2,8,32", help="working-set sizes, in multiples of the GPU tier")
    ap.add_argument("--sweep-gpu-tier", default=None,
                    help="the sweep daemon's GPU tier (default 512MiB; quick: its CPU tier, 2MiB, stands in)")
    ap.add_argument("--sweep-cpu-capacity", default=None, help="sweep daemon CPU tier (default 4GiB)")
    ap.add_argument("--sweep-nvme-capacity", default=None, help="sweep daemon NVMe tier (default 24GiB; quick 256MiB)")
    ap.add_argument("--sweep-requests", type=int, default=None, help="requests per sweep point (default 6; quick 3)")
    ap.add_argument("--sweep-docs", type=int, default=None, help="documents per sweep request (default 4; quick 3)")
    ap.add_argument("--cpu-capacity", default=None, help="serve/qps daemon CPU tier (default 32GiB; quick 512MiB)")
    ap.add_argument("--gpu-capacity", default=None,
                    help="serve/qps daemon GPU tier (default with CUDA: 16GiB, at most a quarter of the device memory "
                         "free once the model and its KV cache are loaded)")
    ap.add_argument("--nvme-capacity", default=None, help="serve/qps daemon NVMe tier (default 24GiB; quick 1GiB)")
    ap.add_argument("--device", default=None, help="engine device (default auto; quick cpu)")
    ap.add_argument("--pic-kernel", default="auto", choices=("auto", "triton", "torch"),
                    help="PicConfig.kernel: auto (Triton on CUDA, torch references on the CPU); triton on the CPU runs "
                         "PIC's kernels under TRITON_INTERPRET (what --check-warmup can see there)")
    ap.add_argument("--merge", nargs="*", default=None, metavar="RUN",
                    help="with RUN paths: join those run JSONs, nothing is measured; alone: measure the phases and "
                         "keep the earlier phases' results of the --json file (this run's phases replace theirs)")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                    help="write the run (default docs/results/serving-tiered-<date>.json)")
    args = ap.parse_args(argv)
    q = args.quick
    want = [p for p in args.phases.split(",") if p]
    bad = [p for p in want if p not in PHASES]
    if bad:
        ap.error(f"--phases: unknown {bad}; choose from {', '.join(PHASES)}")
    args.phases = [p for p in PHASES if p in want]
    try:
        args.limits = parse_limits(args.limit_s, PHASES)
    except ValueError as exc:
        ap.error(f"--limit-s: {exc}")
    if args.merge == [] and args.json is None:
        ap.error("--merge without runs keeps the earlier phases of the --json file: give --json")
    args.workloads = [w for w in args.workloads.split(",") if w]
    from tools.servebench.requests import ALL_TASKS

    bad = [w for w in args.workloads if w not in ALL_TASKS]
    if bad:
        ap.error(f"--workloads: unknown {bad}; choose from {', '.join(ALL_TASKS)}")
    try:
        args.sweep = [float(x) for x in args.sweep.split(",") if x]
    except ValueError:
        ap.error(f"--sweep {args.sweep!r}: comma-separated multiples of the GPU tier, e.g. 0.5,2,8,32")
    if any(x <= 0 for x in args.sweep):
        ap.error("--sweep: every multiple must be > 0")
    if not 0 < args.qps_tolerance < 1:
        ap.error(f"--qps-tolerance {args.qps_tolerance}: must be in (0, 1)")
    if args.warmup_n < 1:
        ap.error(f"--warmup-n {args.warmup_n}: must be >= 1")
    if args.qps_repeats < 1:
        ap.error(f"--qps-repeats {args.qps_repeats}: must be >= 1")
    defaults = dict(preset=("qwen3next-tiny", "qwen3next-bench"), n=(2, 5), max_tokens=(450, None),
                    docs=("2-3", None), qps_requests=(3, 8), qps_max_trials=(6, 8), qps_warmup=(1, 4),
                    sweep_gpu_tier=("2MiB", "512MiB"), sweep_cpu_capacity=(None, "4GiB"),
                    sweep_nvme_capacity=("256MiB", "24GiB"), sweep_requests=(3, 6), sweep_docs=(3, 4),
                    cpu_capacity=("512MiB", "32GiB"), nvme_capacity=("1GiB", "24GiB"), device=("cpu", "auto"))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    for name in ("sweep_gpu_tier", "sweep_nvme_capacity", "cpu_capacity", "nvme_capacity"):
        try:
            _size(getattr(args, name))
        except Exception:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: not a size like 512MiB")
    return args


def model_source(args) -> tuple[str, Optional[str]]:
    """What build_engine loads for `args.preset`, and how it differs from the preset: with
    --quick a real-shape preset is its scaled-down variant (the same layer families and
    routing at CPU size), initialised once and saved to a temporary directory (None: the
    preset itself)."""
    from engine.models.presets import REAL_SHAPE_PRESETS

    if not (args.quick and args.preset in REAL_SHAPE_PRESETS):
        return args.preset, None
    import torch

    from engine.models.weights import build_model, save_model
    from tools.bench_models import scaled_down

    cfg = scaled_down(args.preset)
    d = tempfile.mkdtemp(prefix="bench-tiered-model-")
    save_model(build_model(cfg, "cpu", torch.float32), d)
    return d, cfg.name


def daemon_gpu_capacity(args, device) -> str:
    """The serve daemon's GPU tier: --gpu-capacity, else none without CUDA, else 16 GiB
    or a quarter of the device memory free now (after the model and its KV cache), the
    smaller (a real-shape model leaves less)."""
    if args.gpu_capacity:
        return args.gpu_capacity
    if device.type != "cuda":
        return "0"
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return f"{max(1, min(16 << 10, int(free / 4) >> 20))}MiB"


def _daemon(root: str, cpu: str, gpu: str, nvme: str):
    from kvstore.testing import DaemonProcess

    d = DaemonProcess(Path(tempfile.mkdtemp(prefix=root)), cpu_capacity=cpu, nvme_capacity=nvme, gpu_capacity=gpu,
                      lease_ttl=60.0, entry="kvstore.server")
    d.start(timeout=300)
    return d


def _harness(args, engine, socket: str, *, sweep: bool):
    from dataclasses import replace

    from engine.connector.config import StoreConnectorConfig, device_cache_capacity
    from engine.pic.config import PicConfig
    from tools.servebench.harness import Harness

    cuda = engine.device.type == "cuda"
    conn = StoreConnectorConfig(socket=socket, rpc_timeout_s=30.0, load_timeout_s=60.0, inflight_wait_s=120.0,
                                device_cache_fraction=None if sweep else args.device_cache_fraction,
                                device_cache_bytes=0 if sweep else None,
                                put_tier=("gpu" if cuda else "cpu") if sweep else None)
    budget = device_cache_capacity(conn, engine.device)
    pic = PicConfig(cold_full_fraction=0.5, exact_prefix=not sweep, kernel=args.pic_kernel)
    if budget:  # prefix caching's tree and PIC's exact prefixes: the byte budget of the device cache
        pic = replace(pic, prefix_cache_bytes=budget)
    return Harness(engine, conn, pic, prefix_store=True), budget


def engine_phases(args, engine, socket: str, run: dict, out: dict, log, save, phase) -> None:
    """The phases of `args.phases` that share one engine and daemon (ENGINE_PHASES), in
    order, each under `phase(name)` (its PhaseClock). The untimed warm-up runs first, in
    the first phase's time: every timed workload's procedure (warmup_tasks), rag for the
    pcie and qps phases."""
    from tools.servebench import measure, requests, tiered
    from tools.servebench.kernel_keys import CompileCounter, KernelLaunches

    scale = "tiny" if args.quick else "bench"
    h, budget = _harness(args, engine, socket, sweep=False)
    out["device_cache_bytes"] = budget
    load = lambda task, n: requests.load(task, n, args.seed + 10_000, scale, args.max_tokens,  # noqa: E731
                                         args.docs)
    launches = KernelLaunches() if args.check_warmup else None
    compiles = None
    try:
        with contextlib.ExitStack() as stack:
            if launches is not None:
                stack.enter_context(launches.recording())
            first = True
            for name in (p for p in ENGINE_PHASES if p in args.phases):
                with phase(name) as clock:
                    if first:
                        t0 = time.perf_counter()
                        if launches is not None:
                            launches.label = "warm-up"
                        if engine.device.type == "cuda":  # compile every kernel variant first
                            measure.warm_kernels(h, scale, args.max_tokens, args.docs)
                        kernels_s = time.perf_counter() - t0
                        tasks = warmup_tasks(args.workloads) if "serve" in args.phases else []
                        tasks += ["rag"] if {"pcie", "qps"} & set(args.phases) and "rag" not in tasks else []
                        mark = None if launches is None else (
                            lambda t, m, s: setattr(launches, "label", "warm-up"))
                        out["warmup"] = {"kernels_s": round(kernels_s, 3),
                                         **tiered.warm_up(h, load, tasks, args.warmup_n, mark=mark)}
                        out["warmup"]["total_s"] = round(kernels_s + out["warmup"]["s"], 3)
                        log(f"warm-up (untimed): {out['warmup']['total_s']:.1f} s over {', '.join(tasks)}")
                        if launches is not None:
                            launches.seal()
                        compiles = CompileCounter()  # from here on, a kernel compiled is one the warm-up missed
                        out["warmup"]["compiled_after"] = {}
                        save()
                        first = False
                    kw = {"compiles": compiles} if name == "serve" else {}
                    {"serve": serve_phase, "pcie": pcie_phase, "qps": qps_phase}[name](
                        args, h, run, out, log, save, clock, launches, **kw)
                    if name != "serve":  # serve counts per workload
                        note_compiles(out, name, compiles.since(), log)
        if launches is not None:
            out["warmup"]["cold_launches"] = launches.cold()
            out["warmup"]["kernel_specialisations"] = launches.count()
            save()
        out["connector_pic"] = h.store.metrics.snapshot()
        h.purge()
    finally:
        h.close()


def note_compiles(out: dict, unit: str, grew: dict, log) -> None:
    """Kernels compiled during `unit` after the warm-up (kernel_keys.CompileCounter): kept in
    warmup.compiled_after[unit] and logged; nothing when none was."""
    if grew:
        out["warmup"].setdefault("compiled_after", {})[unit] = grew
        log(f"{unit}: {sum(grew.values())} kernel(s) compiled after the warm-up: {grew}")


def serve_phase(args, h, run, out: dict, log, save, clock, launches=None, compiles=None) -> None:
    """TTFT per workload (module docstring), the break-even bandwidth and what a hit reads."""
    from tools.servebench import requests, tiered
    from tools.servebench.breakdown import mean_breakdown

    scale = "tiny" if args.quick else "bench"
    for task in args.workloads:
        if clock():
            log(f"serve: {clock.stopped} after {clock.elapsed_s():.0f} s; workloads not run: "
                f"{', '.join(t for t in args.workloads if t not in out['workloads'])}")
            break
        t0 = time.perf_counter()
        reqs = requests.load(task, args.n, args.seed, scale, args.max_tokens, args.docs)
        mark = (lambda m, s: None) if launches is None else (
            lambda m, s, _t=task: setattr(launches, "label", f"{_t}/{m}/{s}"))
        w = tiered.ttft_after_twin(h, reqs, mark)
        w["wall_s"] = round(time.perf_counter() - t0, 3)
        out["workloads"][task] = w
        note_compiles(out, f"serve/{task}", compiles.since() if compiles else {}, log)
        log(f"{task}: full {w['full']['warm']['ttft_ms_mean']:.1f} ms, prefix(store) warm "
            f"{w['prefix']['warm']['ttft_ms_mean']:.1f} ms, pic warm {w['pic']['warm']['ttft_ms_mean']:.1f} ms"
            f"; warm hits dev/gpu/cpu/nvme: prefix {tiered.format_hits(w['prefix']['warm']['hits_by_source'])}"
            f", pic {tiered.format_hits(w['pic']['warm']['hits_by_source'])}")
        if task in ("repeat", "chat"):
            for m in ("prefix", "pic"):
                b = mean_breakdown(w[m]["warm"]["breakdown"])
                log(f"  {task} {m} warm breakdown (ms): " + ", ".join(
                    f"{k[:-3]} {b[k]:.1f}" for k in ("lookup_ms", "restore_ms", "miss_ms", "forward_ms", "drain_ms",
                                                     "other_ms")) + f"; store rpcs {b['store_rpcs_per_request']}")
        save()
    if out["workloads"]:
        from tools.servebench.tiered import break_even, signature_parts, stored_by_tier

        out["break_even"] = break_even(stored_by_tier(h), out["workloads"])
        # what a hit reads, by part and dtype: where the bytes could shrink
        out["break_even"]["signature_bytes_by_part"] = signature_parts(h)
        save()


def pcie_phase(args, h, run, out: dict, log, save, clock, launches=None) -> None:
    """Pinned host -> device bandwidth (CUDA), then the serving path's CPU-tier loads: the
    serve phase's hits come from the device cache and the GPU tier, so rag requests run
    once more with every hit loaded from the CPU tier (tiered.cpu_tier_loads)."""
    from tools.servebench import requests, tiered

    scale = "tiny" if args.quick else "bench"
    run["pcie"] = {"pinned_h2d_gbps": tiered.pinned_h2d_gbps()}
    save()
    if clock():
        return
    if launches is not None:
        launches.label = "pcie/cpu-tier-step"
    step = tiered.cpu_tier_loads(h, requests.load("rag", args.n, args.seed, scale, args.max_tokens, args.docs))
    out["cpu_tier_step"] = step
    log(f"cpu-tier step (rag x{step['requests']}): hits dev/gpu/cpu/nvme "
        f"{tiered.format_hits(step['hits_by_source'])}, h2d {step['connector']['h2d_copy_bytes'] / 2**20:.1f} "
        f"MiB at {step['gb_per_s'] or 0:.1f} GB/s")
    save()


def warmup_tasks(workloads: list[str]) -> list[str]:
    """The workloads the warm-up runs for these timed ones: each but `mix`, which stands
    for the workloads its requests come from (tools.servebench.requests)."""
    from tools.servebench.requests import ALL_TASKS

    want = [t for t in workloads if t != "mix"]
    if "mix" in workloads:
        want += [t for t in ALL_TASKS if t != "mix" and t not in want]
    return want


def qps_phase(args, h, run, out: dict, log, save=lambda: None, clock=None, launches=None) -> None:
    """Sustainable rate at the p99 SLO, per method, over repeats (module docstring)."""
    from tools.servebench import requests, tiered

    scale = "tiny" if args.quick else "bench"
    rag = out["workloads"].get("rag")
    if rag is None:  # no serve phase in this process: the idle baseline first
        h.planner("full")
        runs = [h.run_alone(r) for r in requests.load("rag", 3, args.seed + 9, scale, args.max_tokens, args.docs)]
        from tools.servebench.measure import summarize

        base = summarize(runs)
    else:
        base = rag["full"]["warm"]
    slo = args.slo_ms or args.slo_factor * base["ttft_ms_p99"]
    start = 500.0 / base["ttft_ms_mean"]  # half of what full recompute serves back to back
    need = (args.qps_warmup + args.qps_requests * (1 + args.qps_max_trials)) * args.qps_repeats
    pool = requests.load("rag", need, args.seed + 1, scale, args.max_tokens, args.docs)
    rule = f"{args.slo_ms} ms" if args.slo_ms else f"{args.slo_factor} x full-recompute rag p99 (idle)"

    def partial(q: dict) -> None:
        out["qps"] = {**q, "slo_rule": rule, "complete": False}
        save()

    if launches is not None:
        launches.label = "qps"
    q = tiered.qps_repeats(h, pool, args.qps_requests, slo, start, args.qps_repeats, args.qps_tolerance,
                           args.qps_max_trials, args.qps_warmup, seed=args.seed, on_repeat=partial,
                           stop=clock or tiered.never)
    q["complete"] = q["stopped"] is None
    q["slo_rule"] = rule
    out["qps"] = q
    log(f"qps at p99 <= {slo:.0f} ms: prefix(store) {q['prefix']['values']}, pic {q['pic']['values']}"
        + (f" ({q['stopped']} after {len(q['repeats'])} repeats)" if q["stopped"] else ""))
    save()


def sweep_phase(args, source: str, opts: dict, out: dict, log, save, clock=None) -> None:
    import torch

    from engine.builder import EngineConfig, build_engine
    from tools.servebench import requests, tiered

    scale = "tiny" if args.quick else "bench"
    cuda = torch.cuda.is_available() and args.device != "cpu"
    tier = args.sweep_gpu_tier
    if cuda:
        daemon = _daemon("bench-tiered-sweep-", args.sweep_cpu_capacity, tier, args.sweep_nvme_capacity)
    else:  # the CPU tier stands in for the GPU tier
        daemon = _daemon("bench-tiered-sweep-", tier, "0", args.sweep_nvme_capacity)
    engine = build_engine(source, EngineConfig(**opts))
    h, _ = _harness(args, engine, str(daemon.socket), sweep=True)
    try:
        from tools.servebench import measure

        if cuda:
            measure.warm_kernels(h, scale, args.max_tokens, args.docs)
        h.purge()
        load = lambda n, s: requests.load("rag", n, s, scale, args.max_tokens, args.docs)  # noqa: E731
        out["sweep"] = {"gpu_tier": tier, "gpu_tier_stand_in": None if cuda else "cpu",
                        "daemon": {"gpu": tier if cuda else "0", "cpu": args.sweep_cpu_capacity if cuda else tier,
                                   "nvme": args.sweep_nvme_capacity}, "points": []}

        def keep(points):
            out["sweep"]["points"] = points
            save()

        tiered.working_set_sweep(h, lambda n: tiered.make_corpus(load, n, args.seed + 50), _size(tier), args.sweep,
                                 args.sweep_requests, args.sweep_docs, args.seed + 51,
                                 stand_in=None if cuda else "cpu", log=log, save=keep, stop=clock or tiered.never)
        out["sweep"]["stopped"] = clock() if clock else None
        out["connector_sweep"] = h.store.metrics.snapshot()
        save()
    finally:
        h.close()
        daemon.cleanup()
        del engine, h
        gc.collect()  # the model's memory back before another engine is built
        if cuda:
            torch.cuda.empty_cache()


def summarize(presets: dict, pcie: dict) -> dict:
    from tools.servebench import report, tiered

    # report.summarize reads bench_serving's qps layout; this run's qps is summarized here
    base = report.summarize({n: {k: v for k, v in p.items() if k != "qps"} for n, p in presets.items()})
    gains, repeats, sweep, be = [], [], [], {}
    snaps = []
    for name, p in presets.items():
        q = p.get("qps") or {}
        if q.get("gain_vs_prefix"):
            gains.append(q["gain_vs_prefix"]["median"])
        for j, r in enumerate(q.get("repeats") or []):
            repeats.append({"preset": name, "repeat": j, "prefix_qps": r["prefix"]["sustainable_qps"],
                            "pic_qps": r["pic"]["sustainable_qps"], "gain": r["gain_vs_prefix"],
                            "converged": r["prefix"]["converged"] and r["pic"]["converged"]})
        for pt in (p.get("sweep") or {}).get("points") or []:
            sweep.append({"preset": name, **pt})
        if p.get("break_even"):
            be[name] = p["break_even"]["break_even_read_gb_per_s"]
        snaps += [(f"{name}:{phase}", p[k]) for phase, k in (("serve", "connector_pic"), ("sweep", "connector_sweep"))
                  if p.get(k)]
        if (p.get("cpu_tier_step") or {}).get("connector"):
            snaps.append((f"{name}:cpu_tier_step", p["cpu_tier_step"]["connector"]))
    serving = tiered.serving_cpu_to_gpu([s for _, s in snaps])
    # which phases' CPU-tier copies the figure is made of (module docstring)
    serving["by_phase"] = {n: {"copy_bytes": s.get("h2d_copy_bytes", 0), "copy_ms": s.get("h2d_copy_ms_total", 0.0),
                               "gb_per_s": tiered.serving_cpu_to_gpu([s])["gb_per_s"]} for n, s in snaps}
    serving["source"] = [n for n, s in snaps if s.get("h2d_copy_bytes")]
    h2d = pcie.get("pinned_h2d_gbps")
    frac = serving["gb_per_s"] / h2d if serving["gb_per_s"] and h2d else None
    return {"ttft_vs_best_baseline_avg": base["ttft_vs_best_baseline_avg"],
            "ttft_vs_best_baseline_min": base["ttft_vs_best_baseline_min"],
            "exact_repeat_pic_over_prefix_ttft": base["exact_repeat_pic_over_prefix_ttft"],
            "qps_gain_vs_prefix_at_slo_median": statistics.median(gains) if gains else None,
            "qps_repeats": repeats, "cpu_to_gpu_fraction_of_pcie_serving": frac,
            "cpu_to_gpu_serving": {**serving, "pinned_h2d_gbps": h2d},
            "working_set_sweep": sweep, "break_even_read_gb_per_s": be,
            "ttft_vs_full_avg": base["ttft_reduction_vs_full_avg"],
            "ttft_vs_prefix_avg": base["ttft_reduction_vs_prefix_avg"],
            "prefix_reuse_by_workload": base["prefix_reuse_by_workload"]}


def json_path(args, date: str) -> Path:
    return Path(args.json) if args.json else REPO / "docs" / "results" / f"serving-tiered-{date}.json"


def write(args, run: dict) -> dict:
    if args.json is None:
        return run
    run["path"] = str(write_json(json_path(args, run["date"]), run))
    return run


def merge_runs(paths: list[str]) -> dict:
    doc = merge_docs(read_runs(paths, "bench_tiered"))
    doc["merged_from"] = [str(p) for p in paths]
    return doc


def merge_docs(runs: list[dict]) -> dict:
    """Runs (each a run JSON, maybe itself merged) joined into one: per preset, each key
    from the first run that has it (tools.results.merge_presets; workloads one by one),
    the phases' records one by one, the pinned PCIe figure from the first run that
    measured one; the summary recomputed from the joined presets."""
    presets = merge_presets(runs)
    for name, pre in presets.items():
        phases: dict = {}
        for r in runs:
            for ph, rec in ((r["presets"].get(name) or {}).get("phases") or {}).items():
                phases.setdefault(ph, rec)
        pre["phases"] = phases
    pcie = next((r["pcie"] for r in runs if (r.get("pcie") or {}).get("pinned_h2d_gbps")), runs[0].get("pcie") or {})
    configs = []
    for r in runs:
        configs += r["config"] if isinstance(r.get("config"), list) else [r.get("config")]
    return {"date": runs[0].get("date"), "command": " && ".join(r.get("command", "?") for r in reversed(runs)),
            "machine": runs[0].get("machine"), "quick": any(r.get("quick") for r in runs),
            "config": configs, "complete": all(r.get("complete") for r in runs), "pcie": pcie, "presets": presets,
            "summary": summarize(presets, pcie), "wall_s": sum(r.get("wall_s") or 0.0 for r in runs)}


def table(run: dict) -> str:
    s = run["summary"]
    lines = ["tiered serving summary"]
    for k in ("ttft_vs_best_baseline_avg", "ttft_vs_best_baseline_min", "exact_repeat_pic_over_prefix_ttft",
              "qps_gain_vs_prefix_at_slo_median", "cpu_to_gpu_fraction_of_pcie_serving"):
        v = s.get(k)
        lines.append(f"  {k:40s} {v:.3f}" if isinstance(v, float) else f"  {k:40s} {v}")
    for name, v in (s.get("break_even_read_gb_per_s") or {}).items():
        lines.append(f"  break-even read bandwidth {name}: {v if v is None else round(v, 3)} GB/s")
    if s.get("working_set_sweep"):
        lines.append("  working set (x tier)  ttft vs full  hits gpu/cpu/nvme  misses")
        for pt in s["working_set_sweep"]:
            h = pt["hits_by_tier"]
            lines.append(f"  {pt['working_set_x_gpu_tier']:>18.2f}  {pt['ttft_vs_full'] or 0:>11.2f}  "
                         f"{h.get('gpu', 0)}/{h.get('cpu', 0)}/{h.get('nvme', 0):<14}  {pt['miss_segments']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        run = write(args, merge_runs(args.merge))
        print(table(run))
        return 0
    import torch

    from engine.builder import EngineConfig, build_engine, resolve_device
    from tools.bench_serving import engine_options, machine

    if args.quick:
        torch.set_num_threads(1)
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    device = resolve_device(args.device)
    opts = engine_options(args, device)
    preset = args.preset
    date = dt.date.today().isoformat()
    earlier = None
    if args.merge == [] and json_path(args, date).is_file():  # keep the earlier phases of the file
        earlier = read_runs([str(json_path(args, date))], "bench_tiered")[0]
        log(f"--merge: keeping the phases of {json_path(args, date)} this run does not measure")
    source, variant = model_source(args)
    out: dict = {"preset": preset, "model": variant or preset, "device": str(device), "engine": opts, "workloads": {},
                 "phases": {}}
    run = {"date": date, "command": " ".join(["python", "tools/bench_tiered.py",
                                              *(argv if argv is not None else sys.argv[1:])]),
           "machine": machine(), "quick": args.quick, "config": vars(args), "complete": False,
           "pcie": {}, "presets": {preset: out}}

    def save() -> None:
        run["summary"] = summarize(run["presets"], run["pcie"])
        run["wall_s"] = time.perf_counter() - start
        if earlier is None:
            write(args, run)
        else:
            merged = write(args, merge_docs([run, earlier]))
            run["path"] = merged.get("path")

    @contextlib.contextmanager
    def phase(name: str):
        """The phase's clock; its record (limit, wall time, why it stopped) in out["phases"]."""
        clock = PhaseClock(name, args.limits.get(name))
        out["phases"][name] = clock.record(complete=False)
        save()
        yield clock
        out["phases"][name] = clock.record(complete=True)
        log(f"phase {name}: {clock.elapsed_s():.1f} s" + (f", stopped: {clock.stopped}" if clock.stopped else ""))
        save()

    if set(ENGINE_PHASES) & set(args.phases):
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        engine = build_engine(source, EngineConfig(**opts))
        out["engine_build_s"] = round(time.perf_counter() - t0, 3)
        engine.sync_timings = args.sync_timings
        gpu_tier = daemon_gpu_capacity(args, device)  # sized once the model is on the device
        daemon = _daemon("bench-tiered-", args.cpu_capacity, gpu_tier, args.nvme_capacity)
        out["daemon"] = {"gpu": gpu_tier, "cpu": args.cpu_capacity, "nvme": args.nvme_capacity}
        log(f"engine {out['model']} built in {out['engine_build_s']:.1f} s; daemon tiers {out['daemon']}")
        try:
            engine_phases(args, engine, str(daemon.socket), run, out, log, save, phase)
        finally:
            daemon.cleanup()
            del engine
            gc.collect()  # the model's memory back before the sweep builds its own engine
            if cuda:
                torch.cuda.empty_cache()
    if "sweep" in args.phases:
        with phase("sweep") as clock:
            sweep_phase(args, source, opts, out, log, save, clock)
    run["complete"] = True
    save()
    if run.get("path"):
        log(f"wrote {run['path']}")
    print(table(run if earlier is None else merge_docs([run, earlier])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
