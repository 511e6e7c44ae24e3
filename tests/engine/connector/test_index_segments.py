"""Indexing segments ahead of requests (engine.pic.index, LLMEngine.index_segments)
through a REAL kvstore daemon: another engine's first request over the indexed documents
hits every one from the daemon, computes none of them and generates what in-process PIC
generates warm; indexing again computes nothing; bad input and a busy or non-PIC engine
get one clear error."""
from __future__ import annotations

import pytest

from connector_testlib import DOCS, GREEDY, new_engine, prompt, run_one
from engine.connector.errors import StoreUnavailable
from engine.errors import InvalidRequestError, PlanError
from engine.pic.config import PicConfig


def test_a_fresh_engine_hits_every_indexed_document_and_matches_warm_in_process_pic(
        start_daemon, store_engine, memory_engine):
    d = start_daemon()
    mem_engine, mem_planner = memory_engine(pic=PicConfig())
    run_one(mem_engine, mem_planner, prompt((0, 1, 2)), "warm")
    want, _, _ = run_one(mem_engine, mem_planner, prompt((2, 0, 1)), "want")

    indexer, ip = store_engine(d, pic=PicConfig())  # default settings: misses in context
    seen = []
    rep = indexer.index_segments(DOCS + [DOCS[0]], progress=lambda r: seen.append(r.computed))
    assert (rep.segments, rep.computed, rep.present, rep.flushed) == (3, 3, 0, True)
    assert rep.tokens > 0 and rep.batches >= 1 and seen and seen[-1] == 3
    assert ip.store.metrics.snapshot()["puts_stored"] == 3

    engine, planner = store_engine(d, pic=PicConfig())
    out, prep, st = run_one(engine, planner, prompt((2, 0, 1)), "r1")
    assert prep.hit_segments == 3 and prep.miss_segments == 0
    assert st.computed == 0 and st.hits_by_tier["cpu"] == 3
    assert out.token_ids == want.token_ids

    again = engine.index_segments(DOCS)
    assert (again.segments, again.computed, again.present) == (3, 0, 3)


@pytest.mark.parametrize("texts, field", [("## doc", "segments"), ([DOCS[0], ""], "segments[1]"),
                                          ([DOCS[0], 7], "segments[1]")])
def test_bad_segments_are_refused_naming_the_field(start_daemon, store_engine, texts, field):
    engine, _ = store_engine(start_daemon())
    with pytest.raises(InvalidRequestError) as err:
        engine.index_segments(texts)
    assert field in str(err.value)


def test_an_engine_without_signatures_or_with_requests_in_flight_refuses_to_index(start_daemon, store_engine):
    with pytest.raises(PlanError, match="keeps no segment signatures"):
        new_engine().index_segments(DOCS)
    engine, _ = store_engine(start_daemon())
    engine.add_request(prompt((0,)), GREEDY, request_id="busy")
    with pytest.raises(PlanError, match="requests are in the engine"):
        engine.index_segments(DOCS)


def test_indexing_with_the_daemon_gone_fails_instead_of_counting_segments_as_stored(start_daemon, store_engine):
    d = start_daemon()
    engine, _ = store_engine(d)
    d.kill()
    with pytest.raises(StoreUnavailable, match="did not answer"):
        engine.index_segments(DOCS)
