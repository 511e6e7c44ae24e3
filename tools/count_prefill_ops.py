"""How many operations the host launches for one prefill, per method and cache state: a
count that does not depend on the machine (on an H200 PIC's partial-hit requests are
host-bound, each computed token costing 1.3-2x what prefix caching pays;
docs/BENCHMARKS.md).

A model with a bench preset's layer pattern (24 layers: qwen3next-bench's 3 gated
DeltaNet : 1 full attention, ring-bench's 7 scalar decay : 1 full) at tiny widths, random
weights, runs the CUDA path's structure on the CPU: seam-chain layers (`seam_chain="on"`)
and fla's chunk and fused recurrent calls (emulated by the torch recurrence; each call
counts as ONE, as do seam-chain calls, whose insides are not counted). Every other aten op the prefill
dispatches is counted (TorchDispatchMode), split into compute ops and views or no-op
casts (no kernel, but host time), and device reads (item, nonzero, equal: each a host
sync on CUDA; on the CPU every tensor is a host tensor, so reads of host copies, which
sync nothing on CUDA, count too). `launches` = compute ops + fla calls + seam-chain
calls; the idle work a request leaves (alone passes of its misses, `help_idle`) is
counted apart. The request is a rag-like prompt: a system
prompt, `--docs` documents of `--doc-tokens`, a question; states: `warm` (every
document cached, in another order), `half` (every other document cached), `cold`
(nothing cached). Methods: full, prefix (warmed with the documents in another order:
it reuses the system prompt only), pic with alone signatures and with context
signatures (PicConfig.miss_signatures), both misses in context.

    PYTHONPATH=. python tools/count_prefill_ops.py [--presets qwen3next-bench,ring-bench] [--docs 8]
        [--doc-tokens 300] [--json docs/results/prefill-ops-<date>.json]

Prints the table last.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: aten ops that make views or wrap host data: no kernel, host time only (matched by name)
VIEW_OPS = frozenset(("view", "slice", "select", "expand", "expand_as", "as_strided", "unsqueeze", "squeeze",
                      "transpose", "permute", "alias", "detach", "split", "split_with_sizes", "unbind",
                      "_reshape_alias", "reshape", "t", "unfold", "narrow", "diagonal", "lift_fresh",
                      "_unsafe_view", "view_as", "chunk", "flatten", "movedim"))
#: ops that read a value back to the host (a sync on CUDA); fla's own reads are inside its calls
SYNC_OPS = frozenset(("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item"))
STATES = ("warm", "half", "cold")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen3next-bench,ring-bench")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=300, help="tokens per document (> 256: long ranges on fla)")
    ap.add_argument("--seam", type=int, default=16)
    ap.add_argument("--json", nargs="?", const="", default=None)
    args = ap.parse_args(argv)
    if args.docs < 2 or args.doc_tokens < args.seam + 1:
        ap.error("--docs must be >= 2 and --doc-tokens > --seam")
    return args


def _name(op: str) -> str:
    """`aten.slice.Tensor` -> `slice`."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "aten" else op


def _same(out, inp) -> bool:
    """Whether a conversion returned its input's bytes (no copy)."""
    import torch

    return (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.data_ptr() == inp.data_ptr()
            and out.dtype == inp.dtype and out.device == inp.device)


class Counting:
    """Counts aten ops while active; `paused()` stops counting inside an op that counts as one."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if counter.depth == 0:
                    name = str(func)
                    if name.startswith(("aten.to.", "aten.contiguous.")) and args and _same(out, args[0]):
                        name = "alias:" + name  # a no-op conversion: host time, no kernel
                    counter.ops[name] += 1
                return out

        self.mode = Mode()
        self.ops: Counter = Counter()
        self.calls: Counter = Counter()
        self.depth = 0

    def wrap(self, name, fn):
        def inner(*a, **kw):
            if self.depth == 0:
                self.calls[name] += 1
            self.depth += 1
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
        return inner

    def summary(self) -> dict:
        views = sum(n for op, n in self.ops.items() if op.startswith("alias:") or _name(op) in VIEW_OPS)
        total = sum(self.ops.values())
        syncs = sum(n for op, n in self.ops.items() if _name(op) in SYNC_OPS)
        return {"ops": total, "compute_ops": total - views, "view_ops": views, "device_reads": syncs,
                "fla_calls": self.calls["fla"],
                "chain_calls": self.calls["chain"],
                "launches": total - views + self.calls["fla"] + self.calls["chain"],
                "top": self.ops.most_common(8)}


def _model(preset: str):
    import torch

    from engine.models.presets import get_preset
    from engine.models.weights import build_model

    bench = get_preset(preset)
    tiny = get_preset(preset.replace("-bench", "-tiny"))
    cfg = replace(tiny, name=preset + "-shape", layers=bench.layers, max_position_embeddings=65536)
    return build_model(cfg, "cpu", torch.float32, seed=0)


def count_preset(preset: str, args) -> dict:
    import torch

    import engine.pic.seam_chain_layer as scl
    from engine.models.layers import fla_backend
    pic_tests = str(REPO / "tests" / "engine" / "pic")  # the PIC tests' request builders and fla emulation
    if pic_tests not in sys.path:
        sys.path.insert(0, pic_tests)
    from pic_testlib import fla_emulated

    torch.manual_seed(0)
    model = _model(preset)
    counting = Counting()
    saved = (fla_backend.fla_chunk, fla_backend.fla_recurrent, scl.seam_chain)
    fla_backend.fla_chunk = counting.wrap("fla", fla_emulated)
    fla_backend.fla_recurrent = counting.wrap("fla", lambda family, inp, s0: fla_emulated(family, inp, s0))
    scl.seam_chain = counting.wrap("chain", scl.seam_chain)
    try:
        return _count(preset, args, model, counting)
    finally:
        fla_backend.fla_chunk, fla_backend.fla_recurrent, scl.seam_chain = saved


def _count(preset: str, args, model, counting: Counting) -> dict:
    from engine.pic.config import PicConfig
    from engine.pic.planner import make_planner
    from engine.runtime.runner import ModelRunner
    from pic_testlib import FakeTokenizer, execute, make_request, rand_ids

    docs = [rand_ids(args.doc_tokens, 100 + i) for i in range(args.docs)]
    system, question = rand_ids(60, 7), rand_ids(20, 8)
    prompt = [(system, True)] + [(d, True) for d in docs] + [(question, False)]
    other = [(system, True)] + [(d, True) for d in docs[1:] + docs[:1]] + [(question, False)]

    def runner():
        from engine.cache.manager import CacheConfig, CacheManager

        cache = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=1024, num_slots=4))
        r = ModelRunner(model, cache, backend="torch")
        r.backend = "fla"  # the CUDA path's structure; fla_chunk is emulated
        return r

    configs = {"full": PicConfig(method="full"), "prefix": PicConfig(method="prefix")}
    for src in ("alone", "context"):
        # exact_prefix off: the counts compare the signature paths; an exact-prefix hit
        # (and the idle pass that builds its states) is the prefix method's work.
        configs[f"pic-{src}"] = PicConfig(seam=args.seam, miss_path="context", miss_signatures=src, seam_chain="on",
                                          exact_prefix=False)
    out = {}
    for name, cfg in configs.items():
        for state in STATES:
            if name in ("full",) and state != "cold":
                continue
            r = runner()
            planner = make_planner(cfg, model, "count-ops", FakeTokenizer())
            if name == "prefix" and state != "cold":
                execute(planner, r, make_request(other))
            elif name.startswith("pic") and state != "cold":
                cached = docs if state == "warm" else docs[::2]
                execute(planner, r, make_request([(system, True)] + [(d, True) for d in cached] + [(question, False)]))
                while planner.help_idle(r):
                    pass
            counting.ops.clear()
            counting.calls.clear()
            with counting.mode:
                execute(planner, r, make_request(prompt))
            s = counting.summary()
            counting.ops.clear()
            counting.calls.clear()
            with counting.mode:  # the idle work it left (alone passes of its misses)
                while getattr(planner, "help_idle", lambda _r: 0)(r):
                    pass
            s["idle_launches"] = counting.summary()["launches"]
            out[f"{name}/{state}"] = s
            print(f"{preset} {name} {state}: {s}", flush=True)
    return {"preset": preset, "layers": len(model.blocks), "docs": args.docs, "doc_tokens": args.doc_tokens,
            "counts": out}


def table(results) -> str:
    lines = ["| preset | method / state | launches | compute ops | views, no-op casts | device reads | fla calls | "
             "chain calls | idle launches after |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for k, s in r["counts"].items():
            lines.append(f"| {r['preset']} | {k} | {s['launches']} | {s['compute_ops']} | {s['view_ops']} | "
                         f"{s['device_reads']} | {s['fla_calls']} | {s['chain_calls']} | {s['idle_launches']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = [count_preset(p.strip(), args) for p in args.presets.split(",") if p.strip()]
    if args.json is not None:
        path = Path(args.json or REPO / "docs" / "results" / f"prefill-ops-{date.today().isoformat()}.json")
        path.write_text(json.dumps({"args": vars(args), "presets": results}, indent=1))
        print(f"wrote {path}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
