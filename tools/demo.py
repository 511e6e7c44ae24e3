"""Demo: an engine attached to a running kvstore daemon reuses cached segments.

    python -m kvstore.cli serve &            # the daemon (default socket)
    python tools/demo.py                     # then this; run it twice: the second run (a new
                                             # process) restores each exact prefix from the daemon

Starts nothing itself. Given a running daemon (`--socket`, default: the daemon's default
socket), it builds an engine on a tiny preset, attaches it to the daemon
(engine.connector), sends a few segmented prompts from tools/workloads (documents that
recur across requests in different orders) and prints, per request: cached segments
found in the daemon (and the tier they came from; `prefix:<tier>` for an exact prefix
restored whole, engine.pic.exact_prefix), prompt tokens reused, and the
time to first token with PIC through the daemon next to full recomputation of the
same prompt.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", default=None, help="the daemon's socket (default: kvstore's default socket)")
    ap.add_argument("--preset", default="qwen3next-tiny")
    ap.add_argument("--task", default="rag", help="fact, twohop, aggregate, fewshot or rag")
    ap.add_argument("--n", type=int, default=4, help="requests to send")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--last", action="store_true", help="the last run of a series (tools/demo.sh): no 'run again' hint")
    args = ap.parse_args(argv)

    from kvstore.client import KVStoreClient
    from kvstore.errors import KVStoreError

    try:
        with KVStoreClient(args.socket) as kv:
            info = kv.info
            target = kv.target
    except KVStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    import torch

    from engine.builder import EngineConfig, build_engine
    from engine.connector.config import StoreConnectorConfig
    from tools.servebench.harness import Harness
    from tools.servebench.requests import load

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # tiny matmuls run fastest on one thread
    print(f"kvstore daemon pid {info.pid} at {target[5:] if target.startswith('unix:') else target}, "
          f"tiers {', '.join(info.tiers)}")
    engine = build_engine(args.preset, EngineConfig(max_num_seqs=4, kv_cache_tokens=16384))
    print(f"engine: {args.preset} on {engine.device}, model fingerprint {engine.loaded_model.fingerprint[:16]}")
    h = Harness(engine, StoreConnectorConfig(socket=args.socket))
    try:
        reqs = load(args.task, args.n, args.seed, "tiny")
        warm = reqs[0]
        for method in ("full", "pic"):  # first calls compile kernels / warm allocators: not shown
            h.planner(method)
            h.run_alone(warm.__class__("warm-up", "warm-up", ({"text": "warm-up " * 8, "cache": False},)))
        header = f"{'request':<18} {'segments':>8} {'hits':>4} {'from tier':<12} {'reused tokens':>15} " \
                 f"{'TTFT PIC':>9} {'TTFT full':>9} {'speedup':>7}"
        print(header)
        print("-" * len(header))
        for r in reqs:
            h.planner("full")
            full = h.run_alone(r)
            h.planner("pic")
            pic = h.run_alone(r)
            tiers = ",".join(f"{t}:{n}" for t, n in pic.store.get("store_hits_by_tier", {}).items() if n)
            src = pic.store.get("store_prefix_source")
            if src:  # an exact prefix restored (engine.pic.exact_prefix): one hit, from the daemon or the engine
                where = pic.store.get("store_prefix_tier") if src == "store" else "engine"
                tiers = ",".join(x for x in (f"prefix:{where}", tiers) if x)
            tiers = tiers or "-"
            segments = pic.hit_segments + pic.miss_segments
            print(f"{r.id:<18} {segments:>8} {pic.hit_segments:>4} {tiers:<12} "
                  f"{pic.reused_tokens:>6}/{pic.prompt_tokens:<8} {pic.ttft_ms:>7.1f}ms {full.ttft_ms:>7.1f}ms "
                  f"{full.ttft_ms / pic.ttft_ms:>6.2f}x")
        m = h.store.metrics.snapshot()
        reach = ("the daemon answered" if m["store_available"]
                 else "the daemon did not answer: segments were recomputed")
        print(f"\nconnector: {m['hits']} hits, {m['misses']} misses, {m['puts_stored']} objects stored, "
              f"{m['prefix_hits']} exact prefixes loaded; {reach}.")
        if not args.last:
            print("Run again: a new engine process finds every prompt's exact prefix (and segments) in the daemon.")
    finally:
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
