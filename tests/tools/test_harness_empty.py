"""Harness.empty (bench_tiered's cold-stream QPS repeats start from it): after it a
method finds nothing that the runs before it cached, in the daemon or in the engine's
own caches. A real kvstore daemon and a tiny engine (CPU, fp32)."""
from __future__ import annotations

import pytest

from tools.servebench.requests import twin


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (tests/conftest.py)."""


def _rag():
    from tools.servebench import requests

    return requests.load("rag", 1, 11, "tiny", 450, "2-3")[0]


def _daemon_objects(h) -> int:
    fp = h.engine.loaded_model.fingerprint
    h.store.flush()
    return len(h.store.link.call("list", lambda kv: kv.list(fingerprint=fp, limit=1000)))


def test_empty_pic_leaves_nothing_a_request_could_hit(harness):
    req = _rag()
    harness.planner("pic")
    harness.run_alone(twin(req))  # caches its documents: the daemon, the device cache, an exact prefix
    warm = harness.run_alone(req)
    assert warm.hit_segments > 0
    assert _daemon_objects(harness) > 0

    held = harness.store.near.stats().entries  # 0 where the device cache has no capacity (the CPU)
    nodes = harness.pic_planner().exact.tree.num_nodes
    went = harness.empty("pic")
    assert went["daemon_objects"] > 0 and went["device_signatures"] == held
    assert went["exact_prefix_nodes"] == nodes > 0
    assert _daemon_objects(harness) == 0
    assert harness.store.near.stats().entries == 0
    assert harness.pic_planner().exact.tree.num_nodes == 0
    cold = harness.run_alone(req)
    assert cold.hit_segments == 0 and cold.reused_tokens == 0


def test_empty_prefix_gives_a_fresh_tree(harness):
    req = _rag()
    harness.planner("prefix")
    harness.run_alone(req)
    again = harness.run_alone(req)
    assert again.reused_tokens > 0
    before = harness.engine.scheduler.planner

    went = harness.empty("prefix")
    assert went["prefix_nodes"] > 0 and went["daemon_objects"] > 0
    assert harness.engine.scheduler.planner is not before
    assert harness.run_alone(req).reused_tokens == 0
