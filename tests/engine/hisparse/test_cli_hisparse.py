"""The CLI contract `kvengine generate --preset P --hisparse --hisparse-block N --hisparse-topk K
--hisparse-hot H "PROMPT" --json`: the same text as without --hisparse when top-k covers
every block, HiSparse metrics in the JSON; bad settings exit 2 naming the option; `run`
refuses --hisparse with a clear message."""
import json

from typer.testing import CliRunner

from engine.cli import app

PROMPT = "Q: what is the capital of the country where the river flows?\nA:"


def _generate(*extra):
    res = CliRunner().invoke(app, ["generate", "--preset", "gla-tiny", "--device", "cpu", "--max-new-tokens", "12",
                                   *extra, PROMPT, "--json"])
    return res


def test_generate_with_hisparse_prints_the_dense_text_and_hisparse_metrics():
    dense = _generate()
    assert dense.exit_code == 0, dense.output
    hs = _generate("--hisparse", "--hisparse-block", "8", "--hisparse-topk", "64", "--hisparse-hot", "2",
                   "--hisparse-min-context", "0")
    assert hs.exit_code == 0, hs.output
    want, got = json.loads(dense.output), json.loads(hs.output.strip().splitlines()[-1])
    assert got["text"] == want["text"] and "hisparse" not in want
    m = got["hisparse"]
    assert m["blocks_fetched"] > 0 and m["blocks_fetched_per_step"] > 0 and 0 <= m["hot_hit_rate"] < 1
    assert m["read_bytes"]["mirror"] > 0 and m["store"] == "mirror"  # fetched from the pinned host mirror


def test_bad_hisparse_settings_exit_2_naming_the_option():
    res = _generate("--hisparse", "--hisparse-hot", "1")
    assert res.exit_code == 2 and "--hisparse-hot" in res.output


def test_run_with_hisparse_splices_through_it_and_gives_pics_text(tmp_path):
    """`run --hisparse` (PIC): the second request splices the cached segment through the
    HiSparse layer caches and both answer as without HiSparse (every block attended)."""
    reqs = tmp_path / "r.jsonl"
    line = {"segments": [{"text": "The quick brown fox jumps over the lazy dog. ", "cache": True},
                         {"text": "What jumps?", "cache": False}]}
    reqs.write_text("".join(json.dumps({"id": i, **line}) + "\n" for i in ("a", "b")))
    base = ["run", "--preset", "qwen3next-tiny", "--requests", str(reqs), "--max-new-tokens", "6", "--json"]
    plain = CliRunner().invoke(app, base)
    hs = CliRunner().invoke(app, base + ["--hisparse", "--hisparse-block", "4", "--hisparse-min-context", "0"])
    assert plain.exit_code == 0 and hs.exit_code == 0, hs.output
    want = [json.loads(x) for x in plain.stdout.strip().splitlines() if x.startswith("{")]
    got = [json.loads(x) for x in hs.stdout.strip().splitlines() if x.startswith("{")]
    assert [r["text"] for r in got] == [r["text"] for r in want] and len(got) == 2
    assert got[1]["hit_segments"] == 1 and got[1]["reused_tokens"] > 0
    assert "exact-prefix reuse is off" in hs.output


def test_run_refuses_hisparse_with_a_method_that_fills_the_paged_cache(tmp_path):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "a", "segments": [{"text": "hello", "cache": False}]}) + "\n")
    res = CliRunner().invoke(app, ["run", "--preset", "gla-tiny", "--requests", str(reqs), "--hisparse",
                                   "--method", "prefix"])
    assert res.exit_code == 2 and "--hisparse" in res.output and "method 'prefix'" in res.output


def test_prometheus_metrics_carry_the_hisparse_figures():
    from engine.hisparse.metrics import HiSparseMetrics
    from engine.server.metrics import ServerMetrics

    m = HiSparseMetrics(decode_steps=4, blocks_attended=10, hot_hits=6, blocks_fetched=4, graph_steps=3, eager_steps=1)
    m.add_read("cpu", 4096, 0.5)
    m.add_write("nvme", 1000, 2.0)
    metrics = ServerMetrics("tiny")
    metrics.observe_hisparse(m.snapshot())
    text = metrics.render().decode()
    assert "kvengine_hisparse_blocks_fetched_total 4.0" in text
    assert "kvengine_hisparse_blocks_fetched_per_step 1.0" in text
    assert "kvengine_hisparse_hot_hit_ratio 0.6" in text
    assert 'kvengine_hisparse_read_bytes_per_second{tier="cpu"} 8192.0' in text
    assert 'kvengine_hisparse_write_bytes_per_second{tier="nvme"} 500.0' in text
    assert 'kvengine_hisparse_decode_steps_total{mode="graph"} 3.0' in text
    assert 'kvengine_hisparse_decode_steps_total{mode="eager"} 1.0' in text


def test_default_hot_buffer_is_sized_for_the_step_and_reported_resolved():
    hs = _generate("--hisparse", "--hisparse-block", "8", "--hisparse-topk", "64", "--hisparse-min-context", "0")
    assert hs.exit_code == 0, hs.output
    m = json.loads(hs.output.strip().splitlines()[-1])["hisparse"]
    assert m["hot_blocks"] >= 1 + 1 + 64 and m["blocks_staged"] == 0  # auto: sink + recent + KV heads x top-k
