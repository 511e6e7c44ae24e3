"""The serving benchmark's summary and its tables (plain text, fixed columns).

Summary figures (the `summary` of docs/results/serving-<date>.json):
- `ttft_reduction_vs_prefix_avg`: mean over presets and workloads of
  mean warm TTFT with prefix caching / mean warm TTFT with PIC through the daemon (a
  factor: 3.0 means PIC's TTFT is a third of prefix caching's);
- `ttft_reduction_vs_full_avg`: the same against full recomputation;
- `ttft_reduction_vs_best_avg`: the same against the faster of the two baselines per
  workload (prefix caching pays its checkpoints even where it reuses nothing, so it can
  be slower than full recomputation; this figure does not credit PIC for that);
- `*_cold_avg`: the same ratios for cold requests (PIC pays the alone passes);
- `qps_gain_vs_prefix_at_slo`: mean over presets of the sustainable Poisson rate at the
  TTFT SLO with PIC / with prefix caching (None when prefix caching sustained no rate
  tried), the *stream* cache state (a cold start: most segments new);
  `qps_gain_vs_prefix_at_slo_warm`: the same in the *warm* state (each trial's segments
  cached first, in another order: the TTFT figures' state; tools.servebench.measure);
- `sharing_hit_rate_shared` / `_private`: segment hit rate of two engine processes
  sharing one daemon vs each with a private cache;
- `cross_gpu_hit_rate`: the shared hit rate when the two engines ran on different GPUs
  (None otherwise), and `cross_gpu_peer_loads`: loads served from the daemon's GPU tier
  on the other GPU (CUDA IPC, device-to-device);
- `cold_parallel_speedup`: mean over presets of the mean cold TTFT of rag requests on
  one engine alone / with a second, idle engine helping (published: 2.0x with 2 workers);
- `sharing_qps_gain_shared_vs_private`: mean over presets of the sustainable Poisson rate
  of two engines sharing one daemon / with private caches, at one SLO (a fixed ladder of
  rates over both engines).
- `ttft_vs_best_baseline_avg` / `_min`: warm TTFT of the faster baseline (full
  recompute or prefix caching) / PIC's, mean and minimum over presets and workloads
  (issue 23's names; `_avg` equals `ttft_reduction_vs_best_avg`);
- `exact_repeat_pic_over_prefix_ttft`: PIC's warm TTFT / prefix caching's on the
  `repeat` workload (exact repeats), mean over presets (None without it);
- `prefix_reuse_by_workload`: per `preset/workload`, the share of the warm prompts
  prefix caching reused.
"""
from __future__ import annotations

from typing import Any, Optional


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if not a or not b else a / b


def _mean(xs: list[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def summarize(presets: dict[str, dict]) -> dict[str, Any]:
    vs_prefix, vs_full, vs_prefix_cold, vs_full_cold, qps, shared, private = [], [], [], [], [], [], []
    vs_best = []
    cross, peer, cold, qps_warm, pair_qps = [], [], [], [], []
    repeat, reuse = [], {}
    for name, res in presets.items():
        for task, w in res.get("workloads", {}).items():
            reuse[f"{name}/{task}"] = w["prefix"]["warm"].get("reuse_fraction")
            if task == "repeat":
                repeat.append(_ratio(w["pic"]["warm"]["ttft_ms_mean"], w["prefix"]["warm"]["ttft_ms_mean"]))
            pic, pre, full = w["pic"], w["prefix"], w["full"]
            vs_prefix.append(_ratio(pre["warm"]["ttft_ms_mean"], pic["warm"]["ttft_ms_mean"]))
            vs_full.append(_ratio(full["warm"]["ttft_ms_mean"], pic["warm"]["ttft_ms_mean"]))
            base = [x for x in (pre["warm"]["ttft_ms_mean"], full["warm"]["ttft_ms_mean"]) if x]
            vs_best.append(_ratio(min(base), pic["warm"]["ttft_ms_mean"]) if base else None)
            vs_prefix_cold.append(_ratio(pre["cold"]["ttft_ms_mean"], pic["cold"]["ttft_ms_mean"]))
            vs_full_cold.append(_ratio(full["cold"]["ttft_ms_mean"], pic["cold"]["ttft_ms_mean"]))
        q = res.get("qps") or {}
        for got, part in ((qps, q), (qps_warm, q.get("warm") or {})):
            if part.get("prefix") and part["prefix"]["sustainable_qps"]:  # PIC sustaining no rate counts as 0
                got.append((part["pic"]["sustainable_qps"] or 0.0) / part["prefix"]["sustainable_qps"])
        s = res.get("sharing")
        if s and (s.get("qps") or {}).get("gain") is not None:
            pair_qps.append(s["qps"]["gain"])
        if s:
            shared.append(s["shared"]["hit_rate"])
            private.append(s["private"]["hit_rate"])
            if len(set(s["shared"].get("devices", []))) > 1:
                cross.append(s["shared"]["hit_rate"])
                peer.append(s["shared"]["paths"]["peer"]["loads"])
        c = res.get("cold_parallel")
        if c:
            cold.append(c["speedup"])
    return {"ttft_reduction_vs_prefix_avg": _mean(vs_prefix), "ttft_reduction_vs_full_avg": _mean(vs_full),
            "ttft_reduction_vs_best_avg": _mean(vs_best),
            "ttft_reduction_vs_prefix_cold_avg": _mean(vs_prefix_cold),
            "ttft_reduction_vs_full_cold_avg": _mean(vs_full_cold),
            "qps_gain_vs_prefix_at_slo": _mean(qps), "qps_gain_vs_prefix_at_slo_warm": _mean(qps_warm),
            "sharing_hit_rate_shared": _mean(shared), "sharing_hit_rate_private": _mean(private),
            "cross_gpu_hit_rate": _mean(cross), "cross_gpu_peer_loads": sum(peer) if peer else None,
            "cold_parallel_speedup": _mean(cold), "sharing_qps_gain_shared_vs_private": _mean(pair_qps),
            "ttft_vs_best_baseline_avg": _mean(vs_best),
            "ttft_vs_best_baseline_min": min((x for x in vs_best if x is not None), default=None),
            "exact_repeat_pic_over_prefix_ttft": _mean(repeat), "prefix_reuse_by_workload": reuse}


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[_f(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)), line]
    for r in cells[1:]:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def tables(presets: dict[str, dict], summary: dict[str, Any]) -> str:
    parts = []
    rows = []
    for name, res in presets.items():
        for task, w in res.get("workloads", {}).items():
            f, p, c = w["full"]["warm"], w["prefix"], w["pic"]
            rows.append([f"{name}/{task}", f["prompt_tokens_mean"], f["ttft_ms_p50"], f["ttft_ms_p99"],
                         p["cold"]["ttft_ms_p50"], p["warm"]["ttft_ms_p50"], p["warm"]["ttft_ms_p99"],
                         c["cold"]["ttft_ms_p50"], c["warm"]["ttft_ms_p50"], c["warm"]["ttft_ms_p99"],
                         _ratio(p["warm"]["ttft_ms_mean"], c["warm"]["ttft_ms_mean"]),
                         _ratio(f["ttft_ms_mean"], c["warm"]["ttft_ms_mean"]), c["warm"]["reuse_fraction"],
                         p["warm"].get("reuse_fraction")])
    parts.append(_table("TTFT (ms) per workload: full recompute, prefix caching, PIC through the daemon",
                        ["preset/workload", "tokens", "full p50", "full p99", "prefix cold p50", "prefix warm p50",
                         "prefix warm p99", "pic cold p50", "pic warm p50", "pic warm p99", "x vs prefix",
                         "x vs full", "pic reuse", "prefix reuse"], rows))
    rows = []
    for name, res in presets.items():
        q = res.get("qps") or {}
        for label, part in (("stream", q), ("warm", q.get("warm") or {})):
            if part.get("prefix"):
                rows.append([f"{name} {label}", q["slo_ms"], part["prefix"]["sustainable_qps"],
                             part["pic"]["sustainable_qps"],
                             _ratio(part["pic"]["sustainable_qps"], part["prefix"]["sustainable_qps"]),
                             len(part["prefix"]["trials"]) + len(part["pic"]["trials"])])
    if rows:
        parts.append(_table("Sustainable QPS at the TTFT SLO (p99 <= SLO, Poisson arrivals, rag; cache state: "
                            "stream = cold start, warm = every segment cached first)",
                            ["preset / cache", "SLO ms", "prefix qps", "pic qps", "gain", "trials"], rows))
    rows = []
    for name, res in presets.items():
        s = res.get("sharing")
        if s:
            for kind in ("shared", "private"):
                r = s[kind]
                rows.append([f"{name} {kind}", r["requests"], r["hit_rate"], r["segments_computed"],
                             r["segments_waited"], r["ttft_ms_p50"], r["ttft_ms_p99"]])
    if rows:
        parts.append(_table("Two engine processes: one shared daemon vs private caches",
                            ["preset config", "requests", "hit rate", "computed", "waited", "ttft p50",
                             "ttft p99"], rows))
    rows = []
    for name, res in presets.items():
        s = res.get("sharing") or {}
        for task, pr in (s.get("private") or {}).get("tasks", {}).items():
            sh = s["shared"]["tasks"].get(task, {})
            rows.append([f"{name}/{task}", pr["requests"], pr["ttft_ms_p50"], sh.get("ttft_ms_p50"),
                         pr["ttft_ms_p99"], sh.get("ttft_ms_p99"), _ratio(pr["ttft_ms_mean"], sh.get("ttft_ms_mean"))])
        q = s.get("qps")
        if q:
            rows.append([f"{name} QPS at p99 <= {q['slo_ms']:.0f} ms", "-", q["private"]["sustainable_qps"],
                         q["shared"]["sustainable_qps"], "-", "-", q["gain"]])
    if rows:
        parts.append(_table("Two engines per workload, private caches vs one shared daemon (TTFT ms; last row: "
                            "sustainable QPS over both engines, rates " + ", ".join(
                                f"{r:g}" for name, res in presets.items()
                                for r in ((res.get("sharing") or {}).get("qps") or {}).get("rates", [])) + ")",
                            ["preset/workload", "requests", "private p50", "shared p50", "private p99",
                             "shared p99", "x (mean)"], rows))
    rows = []
    for name, res in presets.items():
        s = res.get("sharing")
        if s:
            paths = s["shared"].get("paths", {})
            for path in ("gpu", "cpu", "nvme"):
                p = paths.get(path)
                if p and p["loads"]:
                    rows.append([f"{name} {path}", p["loads"], p["bytes"] / 2**20, p["ms"], p["gb_per_s"]])
            if paths.get("peer", {}).get("loads"):
                rows.append([f"{name} gpu, other GPU", paths["peer"]["loads"], paths["peer"]["bytes"] / 2**20,
                             "-", "-"])
    if rows:
        parts.append(_table("Shared daemon, loads by path (both engines; devices as run)",
                            ["preset path", "loads", "MiB", "loader ms", "GB/s"], rows))
    rows = []
    for name, res in presets.items():
        c = res.get("cold_parallel")
        if c:
            rows.append([name, c["requests"], c["alone"]["cold_segments_mean"], c["alone"]["ttft_ms_mean"],
                         c["helped"]["ttft_ms_mean"], c["speedup"], c["helped"]["offloaded"],
                         " ".join(c["devices"])])
    if rows:
        parts.append(_table("Cold prefill, one engine alone vs helped by an idle engine (rag, mean TTFT ms)",
                            ["preset", "requests", "segments", "alone", "helped", "speedup", "offloaded",
                             "devices"], rows))
    rows = []
    for name, res in presets.items():
        for tier, b in res.get("breakdown", {}).items():
            rows.append([f"{name} {tier}", b["ttft_ms"], b["lookup_ms"], b["load_ms"], b["load_wait_ms"],
                         b["compose_ms"], b["seam_ms"], b["suffix_ms"], b.get("fused_ms")])
    if rows:
        parts.append(_table("Where the TTFT of a PIC hit goes (ms; rag, device-synchronised marks), by tier",
                            ["preset tier", "ttft", "lookup", "load", "load waited", "compose", "seam", "suffix",
                             "one pass"],
                            rows))
    parts.append("summary: " + ", ".join(f"{k}={_f(v, 3)}" for k, v in summary.items() if not isinstance(v, dict)))
    return "\n\n".join(parts)
