"""Eviction policies: LRU order, cost-aware utility, enough bytes, unknown names."""

import pytest

from kvstore.errors import InvalidRequest
from kvstore.eviction import Candidate, CostAwarePolicy, LruPolicy, make_policy


def c(key, size=100, cost=0.0, t=0.0):
    return Candidate(key.encode(), size, cost, t)


def test_lru_evicts_oldest_first_until_enough_bytes():
    cands = [c("new", t=3), c("old", t=1), c("mid", t=2)]
    assert LruPolicy().choose_victims(cands, 150) == [b"old", b"mid"]
    assert LruPolicy().choose_victims(cands, 1) == [b"old"]


def test_policies_return_everything_when_candidates_do_not_cover_the_need():
    cands = [c("a", t=1), c("b", t=2)]
    assert sorted(LruPolicy().choose_victims(cands, 10_000)) == [b"a", b"b"]
    assert sorted(CostAwarePolicy().choose_victims(cands, 10_000)) == [b"a", b"b"]
    assert LruPolicy().choose_victims([], 10) == []


def test_cost_aware_keeps_expensive_per_byte_objects_over_recent_cheap_ones():
    # scores (recency + alpha * value, both in [0, 1]): costly-old 0 + 2*1, cheap-new 1 + 2*0.01,
    # cheap-mid 0.5 + 2*0.01
    cands = [c("costly-old", cost=10.0, t=1), c("cheap-new", cost=0.1, t=3), c("cheap-mid", cost=0.1, t=2)]
    assert CostAwarePolicy(alpha=2.0).choose_victims(cands, 100) == [b"cheap-mid"]
    assert CostAwarePolicy(alpha=2.0).choose_victims(cands, 200) == [b"cheap-mid", b"cheap-new"]
    assert LruPolicy().choose_victims(cands, 100) == [b"costly-old"]


def test_cost_aware_weighs_cost_per_byte_not_cost():
    cands = [c("big", size=10_000, cost=1.0, t=1), c("small", size=100, cost=0.5, t=1)]
    assert CostAwarePolicy().choose_victims(cands, 1) == [b"big"]


def test_cost_aware_with_zero_alpha_or_no_costs_is_lru():
    cands = [c("a", cost=9.0, t=1), c("b", cost=0.0, t=2)]
    assert CostAwarePolicy(alpha=0.0).choose_victims(cands, 1) == [b"a"]
    assert CostAwarePolicy().choose_victims([c("x", t=5), c("y", t=4)], 1) == [b"y"]


def test_make_policy_by_name_and_unknown_name_is_invalid():
    assert isinstance(make_policy("lru"), LruPolicy) and isinstance(make_policy("cost"), CostAwarePolicy)
    with pytest.raises(InvalidRequest, match="'fifo'"):
        make_policy("fifo")
