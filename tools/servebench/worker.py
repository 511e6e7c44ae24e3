"""One engine process of the two-engine experiments (tools.servebench.sharing):

    python -m tools.servebench.worker --spec SPEC.json --out OUT.json

SPEC holds the preset, the engine options (`device` overrides theirs: one GPU per
worker), the requests, the daemon socket (null: PIC over a private in-process cache),
`share_cold` and a barrier directory. The worker builds its engine, warms its kernels
on a prompt of its own, writes `<barrier>/<name>.ready`, waits for `<barrier>/go` (so
both engines run at the same time), then does its `role`:

- `requests` (default): runs its requests one after the other, then its `trials` if any:
  Poisson arrivals at a rate each, every trial started in step with its `peers`;
- `cold`: for each request, a cold run without cold sharing and a cold run with it
  (the request's segments are deleted from the daemon before each), so an idle helper
  can compute part of its cold segments in the second;
- `helper`: an idle engine: computes cold segments other engines offer
  (`engine.help_idle()` every `share_poll_s`) until `<barrier>/stop` appears.

It writes per-request TTFT, hits and store fields, its connector metrics, and how long
its start took (`startup`: engine build, kernel warm-up) to OUT.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _go(barrier: Path, name: str) -> None:
    (barrier / f"{name}.ready").write_text("ready")
    deadline = time.monotonic() + 900
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go signal within 900 s")
        time.sleep(0.01)


def _step(barrier: Path, step: str, name: str, peers: list[str]) -> None:
    """Wait until every peer reached `step` (each writes `<barrier>/<step>.<name>`)."""
    (barrier / f"{step}.{name}").write_text("ready")
    deadline = time.monotonic() + 900
    while not all((barrier / f"{step}.{p}").exists() for p in peers):
        if time.monotonic() > deadline:
            raise SystemExit(f"peers not at step {step} within 900 s")
        time.sleep(0.005)


def _record(run, mode: str = "") -> dict:
    rec = {"id": run.id, "ttft_ms": run.ttft_ms, "hit_segments": run.hit_segments,
           "miss_segments": run.miss_segments, "reused_tokens": run.reused_tokens,
           "prompt_tokens": run.prompt_tokens, "waited": run.store.get("store_waited", 0),
           "computed": run.store.get("store_computed", 0), "offloaded": run.store.get("store_offloaded", 0),
           "segments": run.store.get("store_segments", 0)}
    if mode:
        rec["mode"] = mode
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    t_start = time.perf_counter()

    import torch

    from engine.builder import EngineConfig, build_engine
    from engine.connector.config import StoreConnectorConfig
    from tools.servebench.harness import Harness
    from tools.servebench.requests import BenchRequest

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    opts = dict(spec["engine"])
    if spec.get("device"):
        opts["device"] = spec["device"]
        dev = torch.device(spec["device"])
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)  # Triton kernels launch on the current device, not their tensors'
    engine = build_engine(spec["preset"], EngineConfig(**opts))
    t_built = time.perf_counter()
    connector = None
    if spec.get("socket"):
        connector = StoreConnectorConfig(socket=spec["socket"], share_cold=bool(spec.get("share_cold", True)),
                                         rpc_timeout_s=30.0, load_timeout_s=60.0, inflight_wait_s=120.0,
                                         put_tier=spec.get("put_tier"))
    from engine.pic.config import PicConfig

    harness = Harness(engine, connector, PicConfig(**(spec.get("pic") or {})))
    harness.planner("pic")
    name, role = spec["name"], spec.get("role", "requests")
    warm = BenchRequest(f"{name}-warmup", "warmup", (
        {"text": f"warm-up {name}: " + "abc " * 40, "cache": True},
        {"text": f"warm-up {name}, second: " + "xyz " * 40, "cache": True},
        {"text": f"warm-up {name}, third: " + "pqr " * 40, "cache": True},
        {"text": "Q: ?\nA: ", "cache": False}))
    harness.run_alone(warm)
    if spec.get("warm"):  # compile every kernel variant before the timed part (measure.warm_kernels)
        from tools.servebench.measure import warm_kernels

        w = spec["warm"]
        warm_kernels(harness, w.get("scale", "bench"), w.get("max_tokens"), w.get("docs"),
                     seed=20_000 + 1000 * int(spec.get("index", 0)))  # leaves the pic planner installed
    barrier = Path(spec["barrier"])
    startup = {"build_s": round(t_built - t_start, 3), "warm_s": round(time.perf_counter() - t_built, 3)}
    _go(barrier, name)
    runs = []
    if role == "helper":
        poll = engine.idle_poll_s or 0.01
        while not (barrier / "stop").exists():
            if not engine.help_idle():
                time.sleep(poll)
        harness.store.flush()
    else:
        store = harness.store.cache if connector is not None else None  # the StoreSignatureCache
        share = store.share if store is not None else None
        if role == "cold" and spec["requests"]:  # warm the helped path once (not measured)
            first = spec["requests"][0]
            req = BenchRequest(first["id"] + "-warm", first["task"], tuple(first["segments"]))
            harness.forget(req)
            harness.run_alone(req)
        for r in spec["requests"]:
            req = BenchRequest(r["id"], r["task"], tuple(r["segments"]))
            if role != "cold":
                runs.append({**_record(harness.run_alone(req)), "task": r["task"]})
                continue
            for mode in ("alone", "helped"):
                harness.forget(req)
                store.share = share if mode == "helped" else None
                runs.append(_record(harness.run_alone(req), mode))
            store.share = share
    trials = []
    for i, t in enumerate(spec.get("trials") or []):  # Poisson trials, in step with the peers
        _step(barrier, f"t{i}", name, spec["peers"])
        info: dict = {}
        reqs = [BenchRequest(r["id"], r["task"], tuple(r["segments"])) for r in t["requests"]]
        ttfts = harness.run_poisson(reqs, t["rate"], t["seed"], info=info)
        trials.append({"rate": t["rate"], "ttft_ms": [round(x, 3) for x in ttfts], **info})
    snap = harness.store.metrics.snapshot() if connector is not None else None
    harness.close()
    Path(args.out).write_text(json.dumps({"name": name, "role": role, "device": str(engine.device), "runs": runs,
                                          "trials": trials, "store": snap, "startup": startup}))


if __name__ == "__main__":
    main()
