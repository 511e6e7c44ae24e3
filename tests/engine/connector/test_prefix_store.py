"""Exact-prefix checkpoints as kvstore daemon objects (engine.connector.prefix_store) over a
REAL daemon: the store-backed PIC planner restores an exact repeat from its own tree and,
in another engine, from the daemon, computing only the question, with the tokens of full
recompute; by default a prefix goes to the daemon once this engine reuses it
(`exact_prefix_store="reused"`: a prompt seen once stores nothing), with "always" as
soon as it is computed; a `kvengine run --method prefix --store` process restores what a
PIC process stored (the same objects); the objects carry their own key space and record
kind."""
from __future__ import annotations

import json
from pathlib import Path

from connector_testlib import GREEDY, new_engine, prompt, run_one
from engine.connector.prefix_store import OBJECT_KIND, checkpoint_blob, checkpoint_from_tensors, prefix_key
from engine.pic.config import PicConfig
from engine.pic.prefix import merge_path
from engine.pic.run import attach_planner
from engine.pic.signature_cache import segment_key
from engine.runtime.sampling import SamplingParams
from test_cli_store import kvengine_run

LAYOUT = prompt((0, 1, 2))


def _full_text(layout, params: SamplingParams = GREEDY) -> str:
    engine = new_engine()
    planner = attach_planner(engine, PicConfig(method="full"))
    out, _, _ = run_one(engine, planner, layout, "full", params)
    return out.text


def test_an_exact_repeat_is_restored_from_the_engine_then_from_the_daemon_in_another_engine(start_daemon,
                                                                                          store_engine):
    d = start_daemon()
    engine, planner = store_engine(d)
    out1, rep1, sr1 = run_one(engine, planner, LAYOUT, "a")
    assert rep1.prefix_tokens == 0 and sr1.prefix_source is None  # nothing exact yet: spliced
    while engine.help_idle():  # the exact pass of its cacheable prefix, kept in this engine's tree
        pass
    assert planner.store.flush(30.0)
    assert planner.store.metrics.snapshot()["prefix_puts"] == 0  # seen once: nothing in the daemon yet
    before = planner.store.metrics.snapshot()
    out2, rep2, sr2 = run_one(engine, planner, LAYOUT, "b")
    question = rep2.prompt_tokens - rep2.prefix_tokens
    assert sr2.prefix_source == "engine" and rep2.recomputed_tokens == question
    assert sr2.segments == 0  # no segment left to splice after the restored prefix
    # prefix caching's path after the restore: nothing asked of or given to the daemon
    after = planner.store.metrics.snapshot()
    for name in ("lookup_rpcs", "lookup_keys", "prefix_lookups", "prefix_puts", "puts_queued", "claims", "captured"):
        assert after[name] == before[name], name
    assert planner.exact.pending  # reused: it goes to the daemon while idle, once
    while engine.help_idle():
        pass
    assert planner.store.flush(30.0) and planner.store.metrics.snapshot()["prefix_puts"] == 1
    run_one(engine, planner, LAYOUT, "b2")
    while engine.help_idle():
        pass
    assert planner.store.flush(30.0) and planner.store.metrics.snapshot()["prefix_puts"] == 1
    # a second engine on the same daemon: its tree is empty, the daemon has the checkpoint
    engine2, planner2 = store_engine(d)
    out3, rep3, sr3 = run_one(engine2, planner2, LAYOUT, "c")
    assert sr3.prefix_source == "store" and sr3.prefix_tier in ("cpu", "gpu", "nvme")
    assert rep3.prefix_tokens == rep2.prefix_tokens and rep3.recomputed_tokens == question
    assert planner2.store.metrics.snapshot()["prefix_hits"] == 1
    full = _full_text(LAYOUT)
    assert out2.text == out3.text == full
    # a third engine, a partial match: the three documents restored from the daemon, a new
    # document after them spliced (computed alone here: a miss), then the question
    engine3, planner3 = store_engine(d)
    partial = LAYOUT[:3] + [{"text": "## doc 4\nk4aa: v4aa\nk4bb: v4bb\n", "cache": True}] + LAYOUT[3:]
    _, rep4, sr4 = run_one(engine3, planner3, partial, "d")
    assert sr4.prefix_source == "store" and rep4.prefix_tokens == rep2.prefix_tokens
    assert sr4.segments == 1 and sr4.computed == 1 and rep4.miss_segments == 1
    # the object: its own key space, record kind "prefix-checkpoint", token count = prefix end
    with d.client() as kv:
        records = [r for r in kv.list() if r.meta.extra.get("kind") == OBJECT_KIND]
    assert len(records) == 1 and records[0].meta.token_count == rep2.prefix_tokens


def test_prefix_keys_have_their_own_space_and_blobs_round_trip(start_daemon, store_engine):
    ids = list(range(40))
    assert prefix_key("fp", ids) != segment_key("fp", ids)
    assert prefix_key("fp", ids) != prefix_key("fp", ids[:-1]) != prefix_key("fp2", ids[:-1])
    assert prefix_key("fp", ids, "dtype=bfloat16") != prefix_key("fp", ids)
    d = start_daemon()
    engine, planner = store_engine(d)
    run_one(engine, planner, LAYOUT, "a")
    while engine.help_idle():
        pass
    tree = planner.exact.tree
    path = [n for n in tree._nodes()]
    path.sort(key=lambda n: n.checkpoint.end)
    cp = merge_path([n.checkpoint for n in path])
    blob = checkpoint_blob(cp, "fp")
    assert blob.kind == OBJECT_KIND and blob.token_count == cp.end
    back = checkpoint_from_tensors(blob.meta, blob.tensors, cp.kv[next(iter(cp.kv))][0].device)
    assert back.end == cp.end and back.kv.keys() == cp.kv.keys() and back.states.keys() == cp.states.keys()
    for i in cp.kv:
        assert (back.kv[i][0] == cp.kv[i][0]).all()
    for i in cp.states:
        assert (back.states[i][0] == cp.states[i][0]).all()


def test_kvengine_run_processes_share_exact_prefixes_pic_and_prefix_alike(start_daemon, tmp_path: Path):
    d = start_daemon()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"id": "a", "segments": LAYOUT}) + "\n")
    store = ["--store", str(d.socket)]
    always = tmp_path / "always.toml"
    always.write_text('[pic]\nexact_prefix_store = "always"\n')
    once = kvengine_run(requests, store, {})[0]  # default: a prompt seen once leaves no exact prefix in the daemon
    assert once["store_prefix_source"] is None
    assert kvengine_run(requests, [*store, "--method", "prefix"], {})[0]["store_prefix_source"] is None
    with d.client() as kv:  # what those two stored goes: the next run starts from an empty daemon
        kv.delete([r.key for r in kv.list()])
    # PIC with exact_prefix_store = "always": spliced; its exact prefix computed and stored before exiting
    first = kvengine_run(requests, [*store, "--pic-config", str(always)], {})[0]
    assert first["store_prefix_source"] is None
    # prefix caching in another process, over the objects PIC stored: a hit, nothing stored again
    pre = kvengine_run(requests, [*store, "--method", "prefix"], {})[0]
    assert pre["store_prefix_source"] == "store" and not pre["store_prefix_stored"]
    assert pre["store_prefix_tokens"] == pre["reused_tokens"] > 0
    assert pre["recomputed_tokens"] == pre["prompt_tokens"] - pre["reused_tokens"]
    assert pre["text"] == _full_text(LAYOUT, SamplingParams(temperature=0.0, max_new_tokens=2))  # as kvengine_run


def test_a_foreign_object_under_a_prefix_key_is_never_restored(start_daemon, store_engine):
    """An object under a prefix key that is not this model's checkpoint (another
    fingerprint: a forged or damaged one) is refused: the request is planned as if the
    daemon held nothing (its segments computed alone and spliced)."""
    import torch

    d = start_daemon()
    engine, planner = store_engine(d)
    ids, segs = engine._tokenize(LAYOUT, None)
    from engine.pic.prefix import prefix_bounds

    end = prefix_bounds(segs)[-1][1]
    key = planner.store.checkpoints.key(ids[:end])
    with d.client() as kv:
        kv.put_tensors(key, {"L0.k": torch.zeros(end, 2, 8)}, fingerprint="another-model", token_count=end,
                       meta={"format": "prefix-checkpoint/1", "end": end}, layers={"L0.k": 0},
                       extra={"kind": OBJECT_KIND})
    out, rep, sr = run_one(engine, planner, LAYOUT, "a")
    assert sr.prefix_source is None and rep.prefix_tokens == 0 and rep.miss_segments == 3
    snap = planner.store.metrics.snapshot()
    assert snap["prefix_lookups"] == 1 and snap["prefix_hits"] == 0 and snap["store_errors"] >= 1
