"""Two-daemon serving benchmark of the remote tier: TTFT for segments found only in the
remote tier (Mooncake Store) against full recompute, in one run.

    python tools/bench_remote_serving.py --json PATH          # GPU: qwen3next-bench, rag
    python tools/bench_remote_serving.py --quick --json PATH  # CPU, tiny preset (~1 minute)
    python tools/bench_remote_serving.py --carry DIR ...      # Mooncake carried as files (below)

Starts a real `mooncake_master` (kvstore.remote.testing) and two daemons with
`--remote` ("host 1" and "host 2": separate sockets, directories and arenas), then on one
engine (one model in memory; each daemon gets its own connector):

1. compute: every request of a RAG workload runs once with PIC through daemon 1, which
   computes its segments and puts them; daemon 1 writes them to the remote tier (the
   run waits until its remote writes have drained);
2. remote: per repeat and request, through daemon 2: the request's segments and exact
   prefixes are deleted from daemon 2 (its local tiers only: deletes do not reach the
   remote tier) and from the engine's device cache, so they are found only in the remote
   tier, then the request runs with PIC (`remote`; `--exact-prefix off`, the default,
   composes it from its segments rather than restoring a stored whole prefix); it runs again with PIC, its segments
   now in daemon 2's CPU tier (`local`); and once with full recompute (`recompute`).
   Daemon 2's remote counters before and after each remote run say how many objects the
   remote tier served (`remote_hits`), the store report which tier of daemon 2 they were
   loaded from (`hits_by_tier`).

The JSON (written after each phase, so a run stopped by a time limit keeps what it
measured) has per repeat the p50/p99 TTFT of each method over the requests, and in
`summary` the medians over repeats: `remote_ttft_ms`, `local_ttft_ms`,
`recompute_ttft_ms` (p50s), their p99s, `ttft_vs_recompute` (remote / recompute) and
`remote_hits_total`; `remote_served` is True when every remote run was served by the
remote tier (remote hits > 0 and reused tokens > 0).

Pre-flight: where Mooncake Store cannot be imported or its master not started, the run
prints one line saying why, writes `{"skipped": REASON}` to the JSON and exits 0.

`--carry DIR` (a host without network, e.g. the GPU box): DIR holds the
`mooncake_transfer_engine_non_cuda-*-cp312-*.whl` wheel, `lib/` with the shared
libraries the wheel needs beyond itself and a CUDA image's base (libibverbs.so.1,
libnl-3.so.200, libnl-route-3.so.200, libnuma.so.1, librdmacm.so.1: the Debian packages
libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 librdmacm1) and `lib-curl/` (libcurl.so.4
and its dependencies, for a host without libcurl4). The wheel is unpacked to DIR/py
once, and the run re-executes itself with DIR/py on PYTHONPATH, the wheel's
mooncake_master on PATH, and each of lib/ and lib-curl/ on LD_LIBRARY_PATH when the host
cannot load one of its libraries by itself.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CARRIED = "BENCH_REMOTE_SERVING_CARRIED"  # set in the re-executed process


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, tiny preset and prompts (~1 minute)")
    ap.add_argument("--preset", default=None, help="engine preset (default qwen3next-bench; quick qwen3next-tiny)")
    ap.add_argument("--workload", default="rag", help="tools/servebench workload (default rag)")
    ap.add_argument("--n", type=int, default=None, help="requests (default 4; quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of the remote phase (default 3; quick 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on prompt + answer tokens (quick 450)")
    ap.add_argument("--docs", default=None, help="documents per request MIN-MAX (quick 2-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-capacity", default=None, help="each daemon's CPU tier (default 8GiB; quick 256MiB)")
    ap.add_argument("--segment", default=None, help="Mooncake segment each daemon mounts (default 4GiB; quick 256MiB)")
    ap.add_argument("--remote-timeout", type=float, default=5.0, help="each daemon's --remote-timeout seconds")
    ap.add_argument("--device", default=None, help="engine device (default auto; quick cpu)")
    ap.add_argument("--exact-prefix", default="off", choices=("on", "off"),
                    help="restore whole exact prefixes too (default off: the request is composed from its "
                         "segments, the PIC path a fleet answering one corpus mostly takes)")
    ap.add_argument("--warmup", default="on", choices=("on", "off"),
                    help="compile the engine's kernels on one request of the workload first (off: tests; "
                         "the first measured runs then pay the compiles)")
    ap.add_argument("--carry", type=Path, default=None, metavar="DIR",
                    help="use the Mooncake wheel and libraries in DIR (module docstring)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="write the run here (default docs/results/remote-serving-<date>.json)")
    args = ap.parse_args(argv)
    q = args.quick
    for name, (quick, full) in dict(preset=("qwen3next-tiny", "qwen3next-bench"), n=(2, 4), repeats=(2, 3),
                                     max_tokens=(450, None), docs=("2-3", None), cpu_capacity=("256MiB", "8GiB"),
                                     segment=("256MiB", "4GiB"), device=("cpu", "auto")).items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.n < 1 or args.repeats < 1:
        ap.error("--n and --repeats must be >= 1")
    return args


# ---------------------------------------------------------------------- carried Mooncake
def carried_env(carry: Path) -> dict[str, str]:
    """The environment that makes the Mooncake wheel in `carry` importable (unpacking it
    to carry/py once); SystemExit naming what is missing."""
    carry = carry.resolve()
    wheels = sorted(carry.glob("mooncake_transfer_engine*.whl"))
    py = carry / "py"
    if not (py / "mooncake").is_dir():
        if not wheels:
            raise SystemExit(f"--carry {carry}: no mooncake_transfer_engine*.whl there and no unpacked py/mooncake")
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(py)
        for exe in ("mooncake_master", "mooncake_client", "transfer_engine_bench"):
            p = py / "mooncake" / exe
            if p.exists():
                p.chmod(0o755)  # zipfile drops the mode bits
    env = dict(os.environ)
    join = lambda new, old: os.pathsep.join([new] + ([old] if old else []))  # noqa: E731
    env["PYTHONPATH"] = join(f"{REPO}{os.pathsep}{py}", env.get("PYTHONPATH", ""))
    for libs in (carry / "lib", carry / "lib-curl"):  # only where this host lacks one of them
        missing = [so.name for so in sorted(libs.glob("*.so*")) if not _loads(so.name)]
        if missing:
            env["LD_LIBRARY_PATH"] = join(str(libs), env.get("LD_LIBRARY_PATH", ""))
            print(f"bench_remote_serving: {', '.join(missing)} from {libs}", file=sys.stderr)
    env["PATH"] = join(str(py / "mooncake"), env.get("PATH", ""))
    env[CARRIED] = "1"
    return env


def _loads(soname: str) -> bool:
    """Whether the host's own libraries provide `soname`."""
    import ctypes

    try:
        ctypes.CDLL(soname)
        return True
    except OSError:
        return False


def preflight() -> Optional[str]:
    """Why the remote tier cannot run here (one line), or None."""
    try:
        from kvstore.remote.testing import mooncake_unavailable

        return mooncake_unavailable()
    except Exception as exc:  # noqa: BLE001 - any import trouble is a reason to skip
        return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------- measurement
def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def remote_stats(socket: str) -> dict:
    from kvstore.client import KVStoreClient

    with KVStoreClient(socket) as kv:
        return kv.stats()["remote"]


def drain(socket: str, timeout_s: float) -> dict:
    """Wait until the daemon's remote writes have ended; its remote stats then."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = remote_stats(socket)
        if r["pending_writes"] == 0 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def engine_options(device) -> dict:
    if device.type == "cuda":
        return dict(device=str(device), dtype="auto", max_num_seqs=16, max_num_batched_tokens=16384,
                    prefill_chunk_size=16384, kv_cache_tokens=262144, max_model_len=32768)
    return dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=4096, prefill_chunk_size=4096,
                kv_cache_tokens=32768, max_model_len=8192)


def one_run(run) -> dict:
    return {"id": run.id, "ttft_ms": run.ttft_ms, "prompt_tokens": run.prompt_tokens,
            "reused_tokens": run.reused_tokens, "hit_segments": run.hit_segments,
            "miss_segments": run.miss_segments, "hits_by_tier": dict(run.store.get("store_hits_by_tier", {})),
            "near_hits": run.store.get("store_near_hits", 0), "prefix_source": run.store.get("store_prefix_source"),
            "prefix_tier": run.store.get("store_prefix_tier")}


def summarize(out: dict) -> dict:
    reps = out.get("repeats_done") or []
    if not reps:
        return {}
    med = lambda key: statistics.median(r[key] for r in reps)  # noqa: E731
    remote_runs = [x for r in reps for x in r["remote"]]
    s = {"remote_ttft_ms": med("remote_p50_ms"), "local_ttft_ms": med("local_p50_ms"),
         "recompute_ttft_ms": med("recompute_p50_ms"), "remote_ttft_p99_ms": med("remote_p99_ms"),
         "local_ttft_p99_ms": med("local_p99_ms"), "recompute_ttft_p99_ms": med("recompute_p99_ms"),
         "remote_ttft_ms_spread": [min(r["remote_p50_ms"] for r in reps), max(r["remote_p50_ms"] for r in reps)],
         "recompute_ttft_ms_spread": [min(r["recompute_p50_ms"] for r in reps),
                                      max(r["recompute_p50_ms"] for r in reps)],
         "remote_hits_total": sum(x["remote_hits"] for x in remote_runs),
         "remote_served": all(x["remote_hits"] > 0 and x["reused_tokens"] > 0 for x in remote_runs),
         "repeats": len(reps), "requests": len(reps[0]["remote"])}
    s["ttft_vs_recompute"] = s["remote_ttft_ms"] / s["recompute_ttft_ms"] if s["recompute_ttft_ms"] else None
    s["remote_vs_local"] = s["remote_ttft_ms"] / s["local_ttft_ms"] if s["local_ttft_ms"] else None
    return s


def write(path: Path, out: dict) -> None:
    out["summary"] = summarize(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str) + "\n")
    tmp.replace(path)


def bench(args, out: dict, path: Path, log) -> None:
    import torch

    from engine.builder import EngineConfig, build_engine, resolve_device
    from engine.connector.config import StoreConnectorConfig
    from engine.pic.config import PicConfig
    from kvstore.remote.testing import MooncakeMaster
    from kvstore.testing import DaemonProcess
    from tools.servebench import requests
    from tools.servebench.harness import Harness

    if args.quick:
        torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-remote-serving-"))
    master = MooncakeMaster(root / "master")
    try:
        master.start()
    except RuntimeError as exc:
        out["skipped"] = f"mooncake_master cannot start here: {exc}"
        return
    daemons: list[Any] = []
    harnesses: list[Harness] = []
    try:
        url = f"{master.url}&segment={args.segment}"
        cuda = torch.cuda.is_available() and args.device != "cpu"
        for host in ("host1", "host2"):
            d = DaemonProcess(root / host, cpu_capacity=args.cpu_capacity, nvme_capacity="1GiB", gpu_capacity="0",
                              lease_ttl=60.0, entry="kvstore.server",
                              extra_args=["--remote", url, "--remote-timeout", str(args.remote_timeout)])
            daemons.append(d.start(timeout=300))
        out["daemons"] = {"url": url, "cpu_capacity": args.cpu_capacity, "remote_timeout_s": args.remote_timeout}
        log(f"master at {master.url}; daemons {daemons[0].socket}, {daemons[1].socket}")
        device = resolve_device(args.device)
        t0 = time.perf_counter()
        engine = build_engine(args.preset, EngineConfig(**engine_options(device)))
        out["engine"] = {"preset": args.preset, "device": str(engine.device), "cuda": cuda,
                         "exact_prefix": args.exact_prefix}

        def harness(d) -> Harness:
            h = Harness(engine, StoreConnectorConfig(socket=str(d.socket), rpc_timeout_s=30.0, load_timeout_s=60.0,
                                                     inflight_wait_s=120.0),
                        PicConfig(exact_prefix=args.exact_prefix == "on"))
            harnesses.append(h)
            return h

        h1, h2 = harness(daemons[0]), harness(daemons[1])
        scale = "tiny" if args.quick else "bench"
        if args.warmup == "on":  # compiles: every method on one request of the workload, from an unused seed
            for r in requests.load(args.workload, 1, 10_000, scale, args.max_tokens, args.docs):
                h1.planner("full")
                h1.run_alone(r)
                h1.planner("pic")
                h1.forget(r)
                h1.run_alone(r)  # cold: alone passes + one-pass prefill
                h1.run_alone(r)  # warm
                h1.forget(r)
        log(f"engine ready in {time.perf_counter() - t0:.1f} s")
        reqs = requests.load(args.workload, args.n, args.seed, scale, args.max_tokens, args.docs)
        # phase 1: host 1 computes every request's segments; they reach the remote tier
        h1.planner("pic")
        computed = []
        for r in reqs:
            h1.forget(r)
            computed.append(one_run(h1.run_alone(r)))
        h1.store.flush()
        r1 = drain(str(daemons[0].socket), 120.0)
        out["compute"] = {"runs": computed, "host1_remote": {k: r1[k] for k in (
            "objects_written", "bytes_written", "put_errors", "pending_writes", "errors")}}
        log(f"host 1 computed {len(reqs)} requests; {r1['objects_written']} objects written remotely")
        write(path, out)
        # phase 2: host 2 finds them only in the remote tier
        warm = requests.BenchRequest("warmup2", "warmup", ({"text": "host two warm-up " * 20, "cache": True},
                                                            {"text": "Q: ?\nA: ", "cache": False}))
        h2.planner("pic")
        h2.run_alone(warm)  # the connector's first connection, outside the figures
        h2.forget(warm)
        sock2 = str(daemons[1].socket)
        out["repeats_done"] = []
        for rep in range(args.repeats):
            got: dict[str, list[dict]] = {"remote": [], "local": [], "recompute": []}
            for r in reqs:
                h2.planner("pic")
                h2.forget(r)  # daemon 2's copies and the engine's device cache: remote only now
                before = remote_stats(sock2)
                run = one_run(h2.run_alone(r))
                after = remote_stats(sock2)
                run["remote_hits"] = after["hits"] - before["hits"]
                run["remote_bytes_read"] = after["bytes_read"] - before["bytes_read"]
                run["remote_errors"] = after["errors"] - before["errors"]
                got["remote"].append(run)
                got["local"].append(one_run(h2.run_alone(r)))
                h2.planner("full")
                got["recompute"].append(one_run(h2.run_alone(r)))
            row: dict[str, Any] = {"repeat": rep, **got}
            for m in got:
                ttfts = [x["ttft_ms"] for x in got[m]]
                row[f"{m}_p50_ms"], row[f"{m}_p99_ms"] = pct(ttfts, 50), pct(ttfts, 99)
            out["repeats_done"].append(row)
            log(f"repeat {rep}: remote {row['remote_p50_ms']:.1f} ms, local {row['local_p50_ms']:.1f} ms, "
                f"recompute {row['recompute_p50_ms']:.1f} ms (p50 over {len(reqs)} requests)")
            write(path, out)
        out["host2_remote"] = remote_stats(sock2)
    finally:
        for h in harnesses:
            try:
                h.close()
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                log(f"closing a harness: {exc}")
        for d in daemons:
            d.cleanup()
        master.stop()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.carry is not None and os.environ.get(CARRIED) != "1":
        env = carried_env(args.carry)
        cmd = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env=env)  # LD_LIBRARY_PATH counts only from a process's start
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    date = dt.date.today().isoformat()
    path = Path(args.json) if args.json else REPO / "docs" / "results" / f"remote-serving-{date}.json"
    out: dict[str, Any] = {
        "benchmark": "two daemons on one Mooncake master: TTFT of segments found only in the remote tier vs recompute",
        "date": date, "command": "python tools/bench_remote_serving.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "machine": {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "workload": args.workload, "n": args.n, "max_tokens": args.max_tokens, "docs": args.docs}
    why = preflight()
    if why:
        out["skipped"] = why
    else:
        import mooncake

        from kvstore.remote.testing import master_binary

        out["mooncake"] = {"package": str(Path(mooncake.__file__).parent), "master": master_binary(),
                           "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")}
        bench(args, out, path, log)
    write(path, out)
    if out.get("skipped"):
        print(f"bench_remote_serving: skipped: {out['skipped']}")
        return 0
    s = out["summary"]
    print(f"remote {s['remote_ttft_ms']:.1f} ms, local {s['local_ttft_ms']:.1f} ms, recompute "
          f"{s['recompute_ttft_ms']:.1f} ms (remote / recompute {s['ttft_vs_recompute']:.2f}); "
          f"{s['remote_hits_total']} remote hits; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
