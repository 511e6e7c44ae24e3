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
    python tools/bench_tiered.py --phases qps --qps-repeats 3 --qps-requests 6 --qps-max-trials 6 \
        --qps-warmup 2 --limit-s qps=330 --json $OUT --merge
    # 2b. qps over a corpus indexed ahead (JSON key qps_indexed): ~7.5 min fresh (indexing ~40 s)
    python tools/bench_tiered.py --phases qps --qps-corpus indexed --qps-repeats 3 --qps-requests 6 \
        --qps-max-trials 6 --qps-warmup 2 --slo-ms 587 --limit-s qps=330 --json $OUT --merge
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
    # the serve phase with 10 exact repeats (a ~20 ms host-bound request: 2 cannot tell the methods apart)
    python tools/bench_tiered.py --phases serve,pcie --n 2 --n-workload repeat=10 --limit-s serve=250,pcie=30 --json X
    python tools/bench_tiered.py --phases serve --n 1 --check-warmup --json /root/out/check-warmup.json
    # PIC without cold sharing, so no idle poll (a daemon List RPC) precedes its timed requests
    python tools/bench_tiered.py --phases serve --workloads repeat,chat --n 2 --share-cold off --json /root/out/noshare.json
    # the cold stream with idle passes only for what was seen before (exact prefixes, then
    # alone passes too), and with smaller idle alone passes (the default packs 16384 tokens)
    python tools/bench_tiered.py --phases qps --qps-repeats 3 --qps-requests 6 --qps-max-trials 6 --qps-warmup 2 \
        --slo-ms 587 --limit-s qps=330 --exact-prefix-passes repeated [--idle-alone-passes repeated] \
        [--idle-batch-tokens 4096] --json /root/out/cold-repeated.json
    # the cold stream with PIC's new segments signed from the requests' own passes (no idle
    # alone passes; docs/pic.md "Signatures from the request's own pass")
    python tools/bench_tiered.py --phases qps --qps-repeats 3 --qps-requests 6 --qps-max-trials 6 --qps-warmup 2 \
        --slo-ms 587 --limit-s qps=330 --miss-signatures context --json /root/out/cold-ctx.json

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
  `--qps-max-trials` trials, each `--qps-trial-s` seconds of Poisson arrivals (default 8 x
  the SLO, ~4.6 s; a trial sure to fail is cut short): ~25 s a search with 5 trials, x 2
  methods x `--qps-repeats` (~150 s for 3); alone in its process it first runs 3 rag
  requests for its SLO base and warms up on rag.
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
  warm = after the request's twin only, for both caching methods alike; the two methods
  run each request one after the other, which first alternating, each timed request on
  a quiesced engine: idle work drained, puts stored, the device synchronised), for full
  recompute, prefix caching through the daemon (`--method prefix --store`: its
  checkpoints in the daemon's tiers, its tree bounded like PIC's exact prefixes) and PIC
  through the daemon, with the engine's device cache bounded by
  `--device-cache-fraction` of the free device memory (StoreConnectorConfig). Every
  warm request of prefix caching and PIC records where its TTFT went (`breakdown`:
  lookup, restore, miss, forward, drain, other ms, the daemon calls it made and what
  else used the host meanwhile: the request thread's CPU time against its wall time,
  other threads' and the daemon's CPU time, garbage collections; tools.servebench.
  breakdown, host_usage), the log prints the means for repeat and chat.
- `pcie`: pinned host -> device bandwidth (`pcie.pinned_h2d_gbps`; None without CUDA),
  then the serving path's CPU-tier loads (`cpu_tier_step`, below).
- `qps`: sustainable Poisson rate at p99 TTFT <= SLO (`--slo-factor` x the idle
  full-recompute rag p99 of the serve phase, or `--slo-ms`), found by bracketing and
  bisection to within `--qps-tolerance` (10%), each trial `--qps-trial-s` seconds of
  arrivals (rate x seconds requests, at least `--qps-requests`, at most
  `--qps-max-per-trial`; a trial whose p99 is sure to miss the SLO is cut short, its
  requests aborted: `aborted` in `trials`), `--qps-repeats` (3) times per method
  (prefix caching through the daemon, PIC), on fresh rag requests (tools/servebench/qps_search.py);
  on the cold stream (`--qps-corpus cold`) every search, each repeat's too, starts from
  empty caches (`Harness.empty`: the daemon purged, the method's device cache and
  prefix trees emptied; what went is each search's `before`), so the repeats measure
  the same thing rather than the later ones inheriting the earlier ones' hits, and both
  methods start at half of full recompute's idle rate (500 / its warm rag TTFT); over
  the indexed corpus each method starts at half of what it serves its probe requests
  back to back (`qps_indexed.start_rates`).
- `sweep`: a document corpus whose signatures occupy `--sweep` (0.5,2,8,32) times the GPU
  tier, in a daemon of its own (GPU tier `--sweep-gpu-tier`, puts into it, evictions
  demoting to CPU then NVMe); without CUDA the daemon's CPU tier stands in for the GPU
  tier (recorded as `gpu_tier_stand_in: "cpu"`). The engine's device cache and exact
  prefixes are off there: every hit comes from a daemon tier (hits, bytes and time per
  tier, device memory; tools/servebench/tiered.py). Every phase's PIC loads go through
  the connector's admission (`--tier-admission`: cost, the default, computes a hit whose
  load is expected slower than computing it, counted per point in
  `skipped_slow_hits_by_tier`; always loads every hit).

Also measured, in the serve phase: per preset the break-even disk bandwidth of a hit.
`summary` (issue 23's names): `ttft_vs_best_baseline_avg` / `_min` (warm TTFT of the
faster baseline / PIC's, over workloads), `exact_repeat_pic_over_prefix_ttft` (PIC /
prefix caching warm TTFT on `repeat`), `qps_gain_vs_prefix_at_slo_median` (median over
repeats of PIC / prefix sustainable rate, on the cold stream), `qps_repeats` (each repeat's
rates and gain), `qps_gain_vs_prefix_at_slo_median_indexed_corpus` and
`qps_repeats_indexed_corpus` (the same on a stream over a corpus indexed ahead:
`--qps-corpus indexed`, tools.servebench.tiered_phases.qps_phase),
`cpu_to_gpu_fraction_of_pcie_serving` (CPU-tier -> device copies of the PIC planners in
this run, bytes / copy time, over the pinned H2D bandwidth of the pcie phase, or of the
end of a run without it; None
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
written there (default docs/results/serving-tiered-<date>.json). Where two or more of the
joined runs measured a serve-phase headline field (`ttft_vs_best_baseline_avg`, `_min`,
`exact_repeat_pic_over_prefix_ttft`), the summary holds the median over those runs and
`summary.serve_runs` each run's value with its file (`serve_runs`).

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tools.results import read_runs, write_json  # noqa: E402
from tools.servebench.phase_clock import PhaseClock, parse_limits  # noqa: E402
from tools.servebench.tiered_summary import merge_docs, merge_runs, serve_runs, summarize  # noqa: E402,F401
from tools.servebench.tiered_phases import (ENGINE_PHASES, engine_phases, start_daemon, sweep_phase,  # noqa: E402,F401
                                            warmup_tasks)

#: the phases, in the order a command runs them (serve, pcie and qps share one engine and daemon)
PHASES = ("serve", "pcie", "qps", "sweep")
WORKLOADS = "fact,twohop,aggregate,fewshot,rag,repeat,chat,mix"


def _size(text: str) -> int:
    from kvstore.config import parse_size

    return parse_size(text)


def parse_n_workload(text: str, tasks) -> dict[str, int]:
    """--n-workload "repeat=10,chat=4" -> {"repeat": 10, "chat": 4}; ValueError naming
    what is wrong."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        task, sep, n = item.partition("=")
        task = task.strip()
        if not sep or task not in tasks:
            raise ValueError(f"{item!r}: expected TASK=N with TASK one of {', '.join(tasks)}")
        try:
            out[task] = int(n)
        except ValueError:
            raise ValueError(f"{item!r}: N must be an integer") from None
        if out[task] < 1:
            raise ValueError(f"{item!r}: N must be >= 1")
    return out


def _fraction_or_off(text: str) -> Optional[float]:
    """--cold-full-fraction: a number, or `off` (None: no cold fallback)."""
    if text.strip().lower() == "off":
        return None
    return float(text)


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
    ap.add_argument("--n-workload", default="", metavar="TASK=N[,TASK=N]",
                    help="requests for these workloads instead of --n, e.g. repeat=10 (exact repeats are ~20 ms "
                         "host-bound requests: two cannot tell the methods apart)")
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
    ap.add_argument("--qps-trial-s", type=float, default=None,
                    help="seconds of arrivals per QPS trial: a trial at rate R sends max(--qps-requests, R x this) "
                         "requests, at most --qps-max-per-trial (default 8 x the SLO: a queue growing 10%% faster "
                         "than it drains passes the SLO within it)")
    ap.add_argument("--qps-max-per-trial", type=int, default=None,
                    help="requests per QPS trial at most (default 300; quick 8)")
    ap.add_argument("--qps-corpus", default="cold", choices=("cold", "indexed"),
                    help="the QPS stream: cold (documents unseen before it; JSON key qps) or indexed (another "
                         "corpus, every document indexed ahead through PIC; key qps_indexed)")
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
    ap.add_argument("--tier-admission", default="cost", choices=("cost", "always"),
                    help="PIC's loads of daemon-tier hits: cost (a hit slower to load than to compute is computed "
                         "instead) or always (every hit loaded); StoreConnectorConfig.tier_admission")
    ap.add_argument("--miss-signatures", default="alone", choices=("alone", "context"),
                    help="PicConfig.miss_signatures of PIC's planner: alone (default; new segments signed by idle-time "
                         "alone passes) or context (taken from the request's own pass, no alone pass: the cold "
                         "stream's idle work, docs/pic.md)")
    ap.add_argument("--exact-prefix-passes", default="all", choices=("all", "repeated"),
                    help="PicConfig.exact_prefix_passes of PIC's planner: all (default; every request whose prefix is "
                         "not exact yet queues an idle pass over it) or repeated (only a prefix seen before)")
    ap.add_argument("--idle-alone-passes", default="all", choices=("all", "repeated"),
                    help="PicConfig.idle_alone_passes of PIC's planner: all (default; every miss computed in context "
                         "is queued for an idle alone pass) or repeated (only a segment missed before)")
    ap.add_argument("--idle-batch-tokens", type=int, default=None,
                    help="PicConfig.idle_batch_tokens of PIC's planner: tokens one idle alone pass packs (default 16384)")
    ap.add_argument("--cold-full-fraction", type=_fraction_or_off, default=0.5,
                    help="PicConfig.cold_full_fraction of PIC's planner: a request whose misses hold at least this "
                         "share of its prompt is computed by plain full recompute (default 0.5); off: never")
    ap.add_argument("--miss-path", default="context", choices=("context", "alone"),
                    help="PicConfig.miss_path of PIC's planner: context (default; misses the cold fallback leaves "
                         "are computed in the request's fused pass and signed by idle alone passes) or alone "
                         "(computed alone in the request, one packed pass, and spliced: no idle alone pass)")
    ap.add_argument("--share-cold", default="on", choices=("on", "off"),
                    help="StoreConnectorConfig.share_cold of PIC's connector: on (default) offers cold segments to "
                         "idle engines and, while idle, polls the daemon for others' offers (one List RPC per "
                         "share_poll_s, also in the quiesce before each timed request); off: neither (a diagnostic: "
                         "a timed PIC request then starts after no daemon call, as prefix caching's does)")
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
        args.n_workload = parse_n_workload(args.n_workload, ALL_TASKS)
    except ValueError as exc:
        ap.error(f"--n-workload: {exc}")
    try:
        args.sweep = [float(x) for x in args.sweep.split(",") if x]
    except ValueError:
        ap.error(f"--sweep {args.sweep!r}: comma-separated multiples of the GPU tier, e.g. 0.5,2,8,32")
    if any(x <= 0 for x in args.sweep):
        ap.error("--sweep: every multiple must be > 0")
    if not 0 < args.qps_tolerance < 1:
        ap.error(f"--qps-tolerance {args.qps_tolerance}: must be in (0, 1)")
    if args.cold_full_fraction is not None and not 0 < args.cold_full_fraction <= 1:
        ap.error(f"--cold-full-fraction {args.cold_full_fraction}: must be in (0, 1] or off")
    if args.miss_signatures == "context" and args.miss_path != "context":
        ap.error("--miss-signatures context takes signatures from misses computed in context: it needs "
                 "--miss-path context")
    if args.warmup_n < 1:
        ap.error(f"--warmup-n {args.warmup_n}: must be >= 1")
    if args.qps_repeats < 1:
        ap.error(f"--qps-repeats {args.qps_repeats}: must be >= 1")
    if args.qps_trial_s is not None and not args.qps_trial_s > 0:
        ap.error(f"--qps-trial-s {args.qps_trial_s}: must be > 0")
    defaults = dict(preset=("qwen3next-tiny", "qwen3next-bench"), n=(2, 5), max_tokens=(450, None),
                    docs=("2-3", None), qps_requests=(3, 8), qps_max_trials=(6, 8), qps_warmup=(1, 4), qps_max_per_trial=(8, 300),
                    sweep_gpu_tier=("2MiB", "512MiB"), sweep_cpu_capacity=(None, "4GiB"),
                    sweep_nvme_capacity=("256MiB", "24GiB"), sweep_requests=(3, 6), sweep_docs=(3, 4),
                    cpu_capacity=("512MiB", "32GiB"), nvme_capacity=("1GiB", "24GiB"), device=("cpu", "auto"))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.qps_max_per_trial < args.qps_requests:
        ap.error(f"--qps-max-per-trial {args.qps_max_per_trial}: must be >= --qps-requests ({args.qps_requests})")
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


def json_path(args, date: str) -> Path:
    return Path(args.json) if args.json else REPO / "docs" / "results" / f"serving-tiered-{date}.json"


def write(args, run: dict) -> dict:
    if args.json is None:
        return run
    run["path"] = str(write_json(json_path(args, run["date"]), run))
    return run


def table(run: dict) -> str:
    s = run["summary"]
    lines = ["tiered serving summary"]
    for k in ("ttft_vs_best_baseline_avg", "ttft_vs_best_baseline_min", "exact_repeat_pic_over_prefix_ttft",
              "qps_gain_vs_prefix_at_slo_median", "qps_gain_vs_prefix_at_slo_median_indexed_corpus",
              "cpu_to_gpu_fraction_of_pcie_serving"):
        v = s.get(k)
        lines.append(f"  {k:40s} {v:.3f}" if isinstance(v, float) else f"  {k:40s} {v}")
    for name, v in (s.get("break_even_read_gb_per_s") or {}).items():
        lines.append(f"  break-even read bandwidth {name}: {v if v is None else round(v, 3)} GB/s")
    if s.get("working_set_sweep"):
        lines.append("  working set (x tier)  ttft vs full  hits gpu/cpu/nvme  misses  skipped (slow) gpu/cpu/nvme")
        for pt in s["working_set_sweep"]:
            h, k = pt["hits_by_tier"], pt.get("skipped_slow_hits_by_tier") or {}
            lines.append(f"  {pt['working_set_x_gpu_tier']:>18.2f}  {pt['ttft_vs_full'] or 0:>11.2f}  "
                         f"{h.get('gpu', 0)}/{h.get('cpu', 0)}/{h.get('nvme', 0):<14}  {pt['miss_segments']:<6}  "
                         f"{k.get('gpu', 0)}/{k.get('cpu', 0)}/{k.get('nvme', 0)}")
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
        daemon = start_daemon("bench-tiered-", args.cpu_capacity, gpu_tier, args.nvme_capacity)
        out["daemon"] = {"gpu": gpu_tier, "cpu": args.cpu_capacity, "nvme": args.nvme_capacity}
        log(f"engine {out['model']} built in {out['engine_build_s']:.1f} s; daemon tiers {out['daemon']}")
        try:
            engine_phases(args, engine, str(daemon.socket), run, out, log, save, phase, daemon_pid=daemon.proc.pid)
        finally:
            daemon.cleanup()
            del engine
            gc.collect()  # the model's memory back before the sweep builds its own engine
            if cuda:
                torch.cuda.empty_cache()
    if "sweep" in args.phases:
        with phase("sweep") as clock:
            sweep_phase(args, source, opts, out, log, save, clock)
    if device.type == "cuda" and not run["pcie"].get("pinned_h2d_gbps"):
        # a run without the pcie phase (qps, sweep) still gets its copies' reference
        from tools.servebench.tiered import pinned_h2d_gbps

        run["pcie"] = {"pinned_h2d_gbps": pinned_h2d_gbps()}
    run["complete"] = True
    save()
    if run.get("path"):
        log(f"wrote {run['path']}")
    print(table(run if earlier is None else merge_docs([run, earlier])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
