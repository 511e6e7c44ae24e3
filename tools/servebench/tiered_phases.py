"""The phases of tools/bench_tiered.py (its docstring says what each measures): `serve`,
`pcie` and `qps` share one engine and daemon (`engine_phases` runs them in order after
the untimed warm-up); `sweep` builds its own. Each phase takes the parsed arguments, the
output dict of its preset, a `log` and a `save` (rewrites the JSON) and its PhaseClock
(`clock()` true once past its time limit)."""
from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from kvstore.config import parse_size

#: the phases sharing one engine and daemon, in the order they run
ENGINE_PHASES = ("serve", "pcie", "qps")
#: requests of the indexed QPS stream run alone before each method's searches (its start rate)
PROBES = 4


def start_daemon(root: str, cpu: str, gpu: str, nvme: str):
    from kvstore.testing import DaemonProcess

    d = DaemonProcess(Path(tempfile.mkdtemp(prefix=root)), cpu_capacity=cpu, nvme_capacity=nvme, gpu_capacity=gpu,
                      lease_ttl=60.0, entry="kvstore.server")
    d.start(timeout=300)
    return d


def make_harness(args, engine, socket: str, *, sweep: bool):
    from dataclasses import replace

    from engine.connector.config import StoreConnectorConfig, device_cache_capacity
    from engine.pic.config import PicConfig
    from tools.servebench.harness import Harness

    cuda = engine.device.type == "cuda"
    conn = StoreConnectorConfig(socket=socket, rpc_timeout_s=30.0, load_timeout_s=60.0, inflight_wait_s=120.0,
                                device_cache_fraction=None if sweep else args.device_cache_fraction,
                                device_cache_bytes=0 if sweep else None,
                                put_tier=("gpu" if cuda else "cpu") if sweep else None,
                                tier_admission=getattr(args, "tier_admission", "cost"),
                                share_cold=getattr(args, "share_cold", "on") == "on")
    budget = device_cache_capacity(conn, engine.device)
    pic = PicConfig(cold_full_fraction=getattr(args, "cold_full_fraction", 0.5), exact_prefix=not sweep,
                    kernel=args.pic_kernel, miss_signatures=getattr(args, "miss_signatures", "alone"),
                    miss_path=getattr(args, "miss_path", "context"),
                    exact_prefix_passes=getattr(args, "exact_prefix_passes", "all"),
                    idle_alone_passes=getattr(args, "idle_alone_passes", "all"),
                    idle_batch_tokens=getattr(args, "idle_batch_tokens", None) or PicConfig.idle_batch_tokens)
    if budget:  # prefix caching's tree and PIC's exact prefixes: the byte budget of the device cache
        pic = replace(pic, prefix_cache_bytes=budget)
    return Harness(engine, conn, pic, prefix_store=True), budget


def engine_phases(args, engine, socket: str, run: dict, out: dict, log, save, phase,
                  daemon_pid: Optional[int] = None) -> None:
    """The phases of `args.phases` that share one engine and daemon (ENGINE_PHASES), in
    order, each under `phase(name)` (its PhaseClock). The untimed warm-up runs first, in
    the first phase's time: every timed workload's procedure (warmup_tasks), rag for the
    pcie and qps phases. `daemon_pid`: the daemon's process, whose CPU time each timed
    request's breakdown accounts (tools.servebench.host_usage)."""
    from tools.servebench import measure, requests, tiered
    from tools.servebench.kernel_keys import CompileCounter, KernelLaunches

    scale = "tiny" if args.quick else "bench"
    h, budget = make_harness(args, engine, socket, sweep=False)
    if daemon_pid is not None:
        h.pids["kvstore-daemon"] = daemon_pid
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


def format_host(host: dict) -> str:
    """A request's host usage means (breakdown `host`) in one log field."""
    if not host:
        return "-"
    busy = {**host.get("other_threads_cpu_ms", {}), **host.get("processes_cpu_ms", {})}
    return (f"request thread cpu {host['main_cpu_ms']:.1f} of {host['wall_ms']:.1f} ms wall, gc "
            f"{host['gc_ms']:.1f} ms, others cpu ms {busy or '{}'}")


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
        n = (getattr(args, "n_workload", None) or {}).get(task, args.n)
        reqs = requests.load(task, n, args.seed, scale, args.max_tokens, args.docs)
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
                                                     "other_ms")) + f"; store rpcs {b['store_rpcs_per_request']}"
                    + f"; host {format_host(b['host'])}")
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
    """Sustainable rate at the p99 SLO, per method, over repeats (module docstring), on
    the stream `args.qps_corpus` names (`PROBES` more requests, over the indexed corpus,
    give each method's start rate: half what it serves the last ones back to back): `cold` (key `qps`: a rag stream whose documents
    no request has named before; the caches fill as it runs; every search, each repeat's
    too, starts from empty caches (`Harness.empty`: the daemon purged, the method's
    in-process caches emptied), both methods from half of full recompute's idle rate) or `indexed` (key
    `qps_indexed`: another pool's documents, every one indexed ahead through PIC's
    planner (`LLMEngine.index_segments`), as a RAG deployment indexes its corpus;
    prefix caching cannot index a document for every position, so it gets nothing ahead).
    Method by method (qps_repeats' `before_method`): before each method's searches the
    daemon is emptied, so neither method's objects take the other's tier bytes."""
    from tools.servebench import qps_search, requests, tiered

    scale = "tiny" if args.quick else "bench"
    corpus = getattr(args, "qps_corpus", "cold")
    key = "qps" if corpus == "cold" else "qps_indexed"
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
    # over the indexed corpus each method from half of what it serves back to back when idle
    # (its probe requests, `before_method`), so PIC does not double up from full recompute's
    # rate; on the cold stream every search starts from empty caches (`Harness.empty`), so
    # both from full recompute's
    starts: dict = {}
    trial_s = args.qps_trial_s or 8 * slo / 1e3
    need = qps_search.pool_needed(args.qps_repeats, args.qps_warmup, args.qps_requests, args.qps_max_trials,
                              args.qps_max_per_trial)
    seed = args.seed + (1 if corpus == "cold" else 2)
    # the indexed stream: `need` requests, then 2 more (each method's idle TTFT over the index)
    pool = requests.load("rag", need + (PROBES if corpus == "indexed" else 0), seed, scale, args.max_tokens,
                         args.docs)
    rule = f"{args.slo_ms} ms" if args.slo_ms else f"{args.slo_factor} x full-recompute rag p99 (idle)"
    extra: dict = {"corpus": corpus, "purged": {}}
    pool, probe = pool[:need], pool[need:]

    def before_method(m: str) -> Optional[float]:
        """Each method with the daemon's tiers to itself: what earlier phases and the
        method before stored goes; over the indexed corpus PIC then indexes it, and each
        method starts from half the rate it serves the probe requests back to back."""
        extra["purged"][m] = h.purge()
        if corpus != "indexed":
            return None
        if m == "pic":
            extra["index"] = index_corpus(h, pool, log)
        h.planner(m)
        ttft = [h.run_alone(r).ttft_ms for r in probe]  # the first absorbs one-time costs (kernels, promotions)
        extra.setdefault("idle_ttft_ms", {})[m] = ttft
        save()
        return 500.0 / statistics.median(ttft[1:])

    def partial(q: dict) -> None:
        out[key] = {**q, **extra, "slo_rule": rule, "trial_s": trial_s, "max_per_trial": args.qps_max_per_trial,
                    "complete": False}
        save()

    if launches is not None:
        launches.label = "qps"
    q = qps_search.qps_repeats(h, pool, args.qps_requests, slo, start, args.qps_repeats, args.qps_tolerance,
                               args.qps_max_trials, args.qps_warmup, seed=args.seed, on_repeat=partial,
                               stop=clock or tiered.never, start_rates=starts, trial_s=trial_s,
                               max_per_trial=args.qps_max_per_trial, before_method=before_method,
                               on_trial=_compiled_in_trial(),
                               before_search=(lambda m, j: h.empty(m)) if corpus == "cold" else None)
    q.update(extra)
    q["complete"] = q["stopped"] is None
    q["slo_rule"] = rule
    q["trial_s"], q["max_per_trial"] = trial_s, args.qps_max_per_trial
    out[key] = q
    log(f"qps ({corpus} corpus) at p99 <= {slo:.0f} ms: prefix(store) {q['prefix']['values']}, "
        f"pic {q['pic']['values']}" + (f" ({q['stopped']} after {len(q['repeats'])} repeats)" if q["stopped"] else ""))
    save()


def _compiled_in_trial():
    """qps_search's `on_trial`: the kernels compiled during the trial (a CompileCounter of
    its own, so the phase's count stays whole), as `compiled`; nothing when none was."""
    from tools.servebench.kernel_keys import CompileCounter

    counter = CompileCounter()

    def grew() -> dict:
        g = counter.since()
        return {"compiled": g} if g else {}
    return grew


def index_corpus(h, pool, log) -> dict:
    """Index every cacheable segment of `pool` (its documents and system prompts: the
    corpus its requests draw from) through the PIC planner; what it took. The segments go
    in the reverse order of their first use in the pool, so when the corpus outgrows the
    faster tiers the segments read first (under a Zipf draw, the most read) are the last
    stored, the ones the daemon's LRU keeps in its faster tiers (LLMEngine.index_segments)."""
    texts = list(dict.fromkeys(s["text"] for r in pool for s in r.segments if s["cache"]))[::-1]
    h.planner("pic")
    m0 = h.store.metrics.snapshot()
    last = [time.perf_counter()]

    def progress(rep) -> None:
        if time.perf_counter() - last[0] > 10:
            last[0] = time.perf_counter()
            log(f"  indexing: {rep.computed + rep.present}/{rep.segments} segments, {rep.seconds:.1f} s")

    rep = h.engine.index_segments(texts, progress=progress)
    m1 = h.store.metrics.snapshot()
    puts = {k: m1[k] - m0[k] for k in ("puts_stored", "puts_dropped", "put_bytes") if k in m1}
    log(f"indexed {rep.segments} segments ({rep.tokens} tokens): {rep.computed} computed, {rep.present} present, "
        f"{rep.seconds:.1f} s; puts {puts}")
    return {**rep.to_dict(), "puts": puts}


def sweep_phase(args, source: str, opts: dict, out: dict, log, save, clock=None) -> None:
    import torch

    from engine.builder import EngineConfig, build_engine
    from tools.servebench import requests, tiered

    scale = "tiny" if args.quick else "bench"
    cuda = torch.cuda.is_available() and args.device != "cpu"
    tier = args.sweep_gpu_tier
    if cuda:
        daemon = start_daemon("bench-tiered-sweep-", args.sweep_cpu_capacity, tier, args.sweep_nvme_capacity)
    else:  # the CPU tier stands in for the GPU tier
        daemon = start_daemon("bench-tiered-sweep-", tier, "0", args.sweep_nvme_capacity)
    engine = build_engine(source, EngineConfig(**opts))
    h, _ = make_harness(args, engine, str(daemon.socket), sweep=True)
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

        tiered.working_set_sweep(h, lambda n: tiered.make_corpus(load, n, args.seed + 50), parse_size(tier), args.sweep,
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
