"""One engine process of the sharing experiment (tools.servebench.sharing):

    python -m tools.servebench.worker --spec SPEC.json --out OUT.json

SPEC holds the preset, the engine options, the requests, the daemon socket (null: PIC
over a private in-process cache) and a barrier directory. The worker builds its engine,
warms its kernels on a prompt of its own, writes `<barrier>/<name>.ready`, waits for
`<barrier>/go` (so both engines run at the same time), runs its requests one after the
other and writes per-request TTFT and hits to OUT.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())

    import torch

    from engine.builder import EngineConfig, build_engine
    from engine.connector.config import StoreConnectorConfig
    from tools.servebench.harness import Harness
    from tools.servebench.requests import BenchRequest

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    engine = build_engine(spec["preset"], EngineConfig(**spec["engine"]))
    connector = StoreConnectorConfig(socket=spec["socket"]) if spec.get("socket") else None
    harness = Harness(engine, connector)
    harness.planner("pic")
    name = spec["name"]
    warm = BenchRequest(f"{name}-warmup", "warmup", (
        {"text": f"warm-up {name}: " + "abc " * 40, "cache": True},
        {"text": f"warm-up {name}, second: " + "xyz " * 40, "cache": True},
        {"text": "Q: ?\nA: ", "cache": False}))
    harness.run_alone(warm)
    barrier = Path(spec["barrier"])
    (barrier / f"{name}.ready").write_text("ready")
    deadline = time.monotonic() + 900
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go signal within 900 s")
        time.sleep(0.01)
    runs = []
    for r in spec["requests"]:
        req = BenchRequest(r["id"], r["task"], tuple(r["segments"]))
        run = harness.run_alone(req)
        runs.append({"id": run.id, "ttft_ms": run.ttft_ms, "hit_segments": run.hit_segments,
                     "miss_segments": run.miss_segments, "reused_tokens": run.reused_tokens,
                     "prompt_tokens": run.prompt_tokens, "waited": run.store.get("store_waited", 0)})
    store = harness.store.metrics.snapshot() if connector is not None else None
    harness.close()
    Path(args.out).write_text(json.dumps({"name": name, "runs": runs, "store": store}))


if __name__ == "__main__":
    main()
