"""Host time to turn a loaded signature blob into a signature, per segment: the work the
connector's loader thread does for every hit (engine.connector.loader), stacked blob
parts (engine.connector.codec, the default) side by side with one part per layer and
tensor (the layout before), in one process.

For each preset, a signature of a `--tokens`-token segment is computed on a model with
the preset's layer pattern and part structure (its kinds, families, conv and gates) but
small dimensions, so the CPU computes it in milliseconds: the decode's host cost depends
on the number of parts, not on their bytes. Each layout is encoded once and decoded
`--repeats` times (kvstore.format.decode_tensors + codec.signature_from_blob; the median
per decode is reported, the two layouts interleaved per round).

    PYTHONPATH=. python tools/bench_codec.py [--presets qwen3next-bench,ring-bench,...] [--json PATH]

Prints one table last: parts per blob and microseconds per decode for each layout, and
the ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.connector.codec import signature_blob, signature_from_blob  # noqa: E402
from engine.models.presets import get_preset, list_presets  # noqa: E402
from engine.models.weights import build_model  # noqa: E402
from engine.pic.compute import compute_signature  # noqa: E402
from kvstore import format as fmt  # noqa: E402


def small_model(preset: str):
    """The preset's layer pattern and part structure at small dimensions (module docstring)."""
    cfg = get_preset(preset)
    cfg = dataclasses.replace(
        cfg, hidden_size=64, intermediate_size=128, vocab_size=260, dtype="float32",
        attention=dataclasses.replace(cfg.attention, num_heads=2, num_kv_heads=1, head_dim=16,
                                      rotary_dim=min(cfg.attention.rotary_dim, 8)),
        linear=dataclasses.replace(cfg.linear, num_heads=2, num_v_heads=2, key_dim=16, value_dim=16))
    return build_model(cfg, "cpu", torch.float32, seed=0)


def encode(tensors, meta, layers, token_count: int) -> torch.Tensor:
    return torch.frombuffer(fmt.encode_tensors(tensors, fingerprint="fp", token_count=token_count, meta=meta,
                                               layers=layers), dtype=torch.uint8)


def decode(buf: torch.Tensor):
    header, tensors = fmt.decode_tensors(buf, check=False)
    return signature_from_blob(header.meta, tensors, header.fingerprint, "fp")


def bench_preset(preset: str, tokens: int, repeats: int) -> dict:
    model = small_model(preset)
    with torch.inference_mode():
        sig = compute_signature(model, [3 + i % 250 for i in range(tokens)], [1], 16)  # within the vocabulary
    per_layer, meta, layers = sig.to_tensors()
    flat = encode(per_layer, meta, layers, sig.num_tokens)
    blob = signature_blob(sig, "fp")
    stacked = encode(blob.tensors, blob.meta, blob.layers, sig.num_tokens)
    for buf in (flat, stacked):  # warm-up, and both decode to the same signature
        back, _, _ = decode(buf).to_tensors()
        assert set(back) == set(per_layer) and all(torch.equal(back[k], per_layer[k]) for k in back)
    times: dict[str, list[float]] = {"per_layer": [], "stacked": []}
    for _ in range(repeats):
        for name, buf in (("per_layer", flat), ("stacked", stacked)):
            t0 = time.perf_counter()
            decode(buf)
            times[name].append((time.perf_counter() - t0) * 1e6)
    per, st = statistics.median(times["per_layer"]), statistics.median(times["stacked"])
    return {"preset": preset, "layers": len(model.blocks), "parts_per_layer_layout": len(per_layer),
            "parts_stacked": len(blob.tensors), "us_per_layer_layout": per, "us_stacked": st,
            "speedup": per / st if st else None}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default=None, help="comma-separated (default: every bench preset)")
    ap.add_argument("--tokens", type=int, default=64, help="segment length of the signature")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    args = ap.parse_args(argv)
    names = args.presets.split(",") if args.presets else [p.name for p in list_presets() if p.scale == "bench"]
    torch.set_num_threads(1)
    rows = [bench_preset(p, args.tokens, args.repeats) for p in names]
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "codec", "rows": rows}, indent=1) + "\n")
    print(f"{'preset':<18} {'layers':>6} {'parts (per layer)':>17} {'parts (stacked)':>15} "
          f"{'us (per layer)':>14} {'us (stacked)':>12} {'x':>5}")
    for r in rows:
        print(f"{r['preset']:<18} {r['layers']:>6} {r['parts_per_layer_layout']:>17} {r['parts_stacked']:>15} "
              f"{r['us_per_layer_layout']:>14.0f} {r['us_stacked']:>12.0f} {r['speedup']:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
