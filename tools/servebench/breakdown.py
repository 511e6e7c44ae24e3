"""Where one request's TTFT went (`ttft_breakdown`), for the tiered benchmark's warm
requests of each method (tools/bench_tiered.py): the parts, in milliseconds of the
request's own timeline (engine.pic.report's step labels, engine.runtime's timeline):

- `lookup_ms`: finding what to reuse: prefix-tree matches, exact-prefix finds and
  signature lookups (the store RPCs among them: `store_rpcs`);
- `restore_ms`: restoring it into the request's cache: prefix checkpoints restored,
  segments spliced outside a fused pass (the plan's `load` steps);
- `miss_ms`: alone passes of missing segments;
- `forward_ms`: the model's prefill of the rest (fused pass, seams, suffix, prefix
  caching's boundary checkpoints);
- `drain_ms`: from the end of the host's prefill steps to the first token: the device
  work the host had queued but not waited for, and sampling;
- `other_ms`: the rest of the TTFT (scheduling, planning outside the lookups, host
  bookkeeping between steps).

Without device synchronisation (`synced` False, the default: syncs would change the
TTFT being explained) the step times are the host's: a step that only queues device
work is short and its device time lands in the next step that waits, or in `drain_ms`.
With `LLMEngine.sync_timings` on (bench_tiered `--sync-timings`, a diagnostic run) each
step's time is its device time. `store_rpcs` counts the daemon calls made while the
request was in flight (tools.servebench.harness), by call name. `host`: what else used
the host meanwhile (tools.servebench.host_usage: the request thread's CPU time against
its wall time, other threads' and the daemon's CPU time, garbage collections): a TTFT
slower in every part alike (the pure-Python lookup too) is the host's, not the method's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tools.servebench.host_usage import mean_host

if TYPE_CHECKING:
    from tools.servebench.harness import Run

PARTS = ("lookup_ms", "restore_ms", "miss_ms", "forward_ms", "drain_ms", "other_ms")


def ttft_breakdown(run: "Run") -> dict:
    """The parts of `run`'s TTFT (module docstring); they sum to `ttft_ms`."""
    sp, tl, st = run.split, run.timeline, run.store or {}
    out = {"ttft_ms": round(run.ttft_ms, 3),
           "lookup_ms": sp.get("lookup_ms", 0.0),
           "restore_ms": sp.get("load_compose_ms", 0.0),
           "miss_ms": sp.get("miss_ms", 0.0),
           "forward_ms": sum(sp.get(k, 0.0) for k in ("fused_ms", "seam_ms", "suffix_ms", "checkpoint_ms")),
           "drain_ms": tl.get("after_ms", 0.0)}
    out["other_ms"] = run.ttft_ms - sum(out[k] for k in PARTS[:-1])
    for k in PARTS:
        out[k] = round(out[k], 3)
    out.update({"queue_ms": round(tl.get("queue_ms", 0.0), 3), "synced": bool(run.synced),
                "reused_tokens": run.reused_tokens, "prompt_tokens": run.prompt_tokens,
                "hit_segments": run.hit_segments, "prefix_source": st.get("store_prefix_source"),
                "store_load_wait_ms": st.get("store_load_wait_ms"), "store_rpcs": dict(run.rpcs),
                "host": dict(run.host)})
    return out


def mean_breakdown(rows: list[dict]) -> dict:
    """The parts' means over `rows` (ttft_breakdown dicts), and the store RPCs per request."""
    if not rows:
        return {}
    out = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in ("ttft_ms",) + PARTS}
    names = sorted({n for r in rows for n in r["store_rpcs"]})
    out["store_rpcs_per_request"] = {n: sum(r["store_rpcs"].get(n, 0) for r in rows) / len(rows) for n in names}
    out["host"] = mean_host([r.get("host") or {} for r in rows])
    return out
