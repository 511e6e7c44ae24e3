"""Cost admission of daemon-tier hits (engine.connector.tier_admission, through a REAL
kvstore daemon, tiny preset on the CPU): a hit whose tier reads slower than computing its
positions is not loaded but computed in context (all of them: the cold fallback's full
recompute, same tokens as full recompute), counted per tier in the request's store
report and the metrics, and an NVMe one is promoted to the CPU tier in the background;
with `tier_admission="always"` the same hits are loaded. The read-rate estimate and the
policies are pinned on their own too."""
from __future__ import annotations

import pytest

from connector_testlib import prompt, run_one, wait_until
from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorConfigError
from engine.connector.settings import PicSettingsError, settings_from_mapping
from engine.connector.tier_admission import (MIN_MEASURED_BYTES, SEED_GB_PER_S, AlwaysAdmit, CostAdmission,
                                             TierReadRates)
from engine.pic.config import PicConfig

#: a cold request falls back to full recompute: the planner measures a full pass's cost per token
PIC = PicConfig(cold_full_fraction=0.5, miss_path="alone")
#: the defaults (misses in context, no fallback): a cold request's one pass computes everything
#: in context, which the planner measures as a full pass
DEFAULT = PicConfig()
SLOW = 1e-6  # GB/s: a 100 KB signature would take ~100 s to read


def stored_segments(engine, planner, d) -> list[bytes]:
    """Run the cold request (full recompute, its cost measured), store its three segments
    by idle help; their keys in prompt order (docs 0, 1, 2)."""
    planner.costs.min_tokens = 1  # the tiny prompts are far below the default floor
    _, rep, _ = run_one(engine, planner, prompt((0, 1, 2)), "cold")
    assert rep.hit_segments == 0 and planner.costs.ms_per_token("full") is not None
    keys = list(planner.deferred)
    assert engine.help_idle() == 3 and planner.store.flush()
    with d.client() as kv:
        assert all(e.hit and e.tier == "cpu" for e in kv.lookup(keys))
    return keys


def full_tokens(memory_engine, segments) -> list[int]:
    engine, planner = memory_engine(pic=PicConfig(method="full"))
    return run_one(engine, planner, segments, "full")[0].token_ids


@pytest.mark.parametrize("pic", [PIC, DEFAULT], ids=["cold-fallback", "in-context"])
def test_hits_slower_to_load_than_to_compute_are_recomputed_and_match_full_recompute(
        start_daemon, store_engine, memory_engine, pic):
    d = start_daemon()
    p = prompt((2, 0, 1))
    want = full_tokens(memory_engine, p)
    engine, planner = store_engine(d, pic=pic)
    stored_segments(engine, planner, d)
    planner.store.cache.loader.rates.set("cpu", SLOW)
    out, rep, st = run_one(engine, planner, p, "slow")
    assert out.token_ids == want
    # every hit skipped: the cold fallback computes the prompt (their tokens are its bulk), or
    # without it the one pass computes each where it would have been spliced
    assert rep.cold_full == (pic is PIC) and rep.slow_hit_segments == 3
    assert rep.hit_segments == 0 and rep.reused_tokens == 0 and rep.miss_tokens == 0
    assert st.skipped_by_tier == {"gpu": 0, "cpu": 3, "nvme": 0} and st.hits_by_tier["cpu"] == 0
    assert st.as_dict()["store_skipped_slow_hits"]["cpu"] == 3
    snap = planner.store.metrics.snapshot()
    assert snap["skipped_slow_hits"]["cpu"] == 3 and snap["loads"]["cpu"] == 0
    with d.client() as kv:
        assert kv.stats()["leases"] == 0  # nothing was leased for them


def test_a_slow_nvme_hit_is_computed_in_context_beside_loaded_cpu_hits_and_promoted(
        start_daemon, store_engine, memory_engine):
    d = start_daemon(nvme_capacity="64MiB")
    engine, planner = store_engine(d, pic=PIC)
    keys = stored_segments(engine, planner, d)
    with d.client() as kv:  # docs 0 and 1 in the CPU tier, doc 2 on NVMe
        kv.evict("cpu")
        assert kv.prefetch(keys[:2], tier="cpu") == 2
        assert [e.tier for e in kv.lookup(keys)] == ["cpu", "cpu", "nvme"]
    rates = planner.store.cache.loader.rates
    rates.set("nvme", SLOW)
    out, rep, st = run_one(engine, planner, prompt((2, 0, 1)), "mixed")
    assert not rep.cold_full and rep.slow_hit_segments == 1 and rep.hit_segments == 2
    assert st.hits_by_tier == {"gpu": 0, "cpu": 2, "nvme": 0} and st.skipped_by_tier["nvme"] == 1
    assert st.computed == 0 and rep.miss_tokens == 0  # computed in context: no alone pass, nothing put
    # the same positions in context, by the in-process planner with doc 2 left uncached
    ref_engine, ref_planner = memory_engine()
    run_one(ref_engine, ref_planner, prompt((0, 1)), "warm")
    segs = prompt((2, 0, 1))
    segs[0] = {**segs[0], "cache": False}
    assert out.token_ids == run_one(ref_engine, ref_planner, segs, "ref")[0].token_ids
    # the skipped object was promoted in the background, timed as an NVMe read
    with d.client() as kv:
        wait_until(lambda: kv.lookup(keys[2:])[0].tier == "cpu", what="promotion of the skipped hit")
    wait_until(lambda: rates.gb_per_s("nvme") > SLOW, what="the promotion's measured rate")


def test_of_several_skipped_nvme_hits_one_is_promoted_at_a_time(start_daemon, store_engine):
    """Skipped NVMe hits are promoted one per batch and never while another promotion
    runs (engine.connector.loader: promotions can demote under the daemon's lock)."""
    d = start_daemon(nvme_capacity="64MiB")
    engine, planner = store_engine(d, pic=PIC)
    keys = stored_segments(engine, planner, d)
    with d.client() as kv:
        kv.evict("cpu")
        assert [e.tier for e in kv.lookup(keys)] == ["nvme"] * 3
    rates = planner.store.cache.loader.rates
    rates.set("nvme", SLOW)
    _, rep, st = run_one(engine, planner, prompt((2, 0, 1)), "all-skipped")
    assert rep.slow_hit_segments == 3 and st.skipped_by_tier["nvme"] == 3
    with d.client() as kv:
        wait_until(lambda: not planner.store.cache.loader._promoting.locked(), what="the promotion's end")
        tiers = [e.tier for e in kv.lookup(keys)]
    assert sorted(tiers) == ["cpu", "nvme", "nvme"]  # the batch's first skipped hit only


def test_with_always_the_slow_tier_is_loaded_anyway(start_daemon, store_engine, memory_engine):
    d = start_daemon()
    p = prompt((2, 0, 1))
    ref_engine, ref_planner = memory_engine()
    run_one(ref_engine, ref_planner, prompt((0, 1, 2)), "warm")
    want = run_one(ref_engine, ref_planner, p, "ref")[0].token_ids
    engine, planner = store_engine(d, pic=PIC, tier_admission="always")
    stored_segments(engine, planner, d)
    planner.store.cache.loader.rates.set("cpu", SLOW)
    out, rep, st = run_one(engine, planner, p, "loaded")
    assert out.token_ids == want
    assert not rep.cold_full and rep.slow_hit_segments == 0 and rep.hit_segments == 3
    assert st.hits_by_tier["cpu"] == 3 and sum(st.skipped_by_tier.values()) == 0
    assert planner.store.metrics.snapshot()["skipped_slow_hits"] == {"gpu": 0, "cpu": 0, "nvme": 0}


def test_read_rates_start_from_their_seeds_and_follow_measured_loads():
    r = TierReadRates(smoothing=0.5)
    assert r.gb_per_s("nvme") == SEED_GB_PER_S["nvme"]
    r.observe("nvme", MIN_MEASURED_BYTES - 1, 1e-6)  # too small to count
    assert r.gb_per_s("nvme") == SEED_GB_PER_S["nvme"]
    r.observe("nvme", 4_000_000_000, 1000.0)  # the first measurement replaces the seed
    assert r.gb_per_s("nvme") == pytest.approx(4.0)
    r.observe("nvme", 2_000_000_000, 1000.0)
    assert r.gb_per_s("nvme") == pytest.approx(3.0)
    assert r.load_ms("nvme", 3_000_000_000) == pytest.approx(1000.0)
    assert r.snapshot()["measured_loads"]["nvme"] == 2
    with pytest.raises(ValueError, match="gb_per_s=0"):
        r.set("cpu", 0)
    with pytest.raises(ValueError, match="tier='tape'"):
        r.set("tape", 1.0)


def test_cost_admission_loads_a_hit_unless_its_load_takes_longer_than_its_compute():
    r = TierReadRates()
    r.set("nvme", 1.0)  # 1 GB/s: 100 MB in 100 ms
    cost = CostAdmission(r)
    assert cost.admit("nvme", 100_000_000, compute_ms=150.0)
    assert not cost.admit("nvme", 100_000_000, compute_ms=50.0)
    assert cost.admit("nvme", 100_000_000, compute_ms=None)  # no compute estimate yet: load it
    assert AlwaysAdmit().admit("nvme", 100_000_000, compute_ms=1e-9)


def test_cost_admission_always_loads_gpu_tier_hits():
    r = TierReadRates()
    r.set("gpu", SLOW)  # a first IPC open measured as a rate
    assert CostAdmission(r).admit("gpu", 100_000_000, compute_ms=1e-3)
    r.set("cpu", SLOW)
    assert not CostAdmission(r).admit("cpu", 100_000_000, compute_ms=1e-3)


def test_cost_admission_loads_one_hit_of_a_tier_after_skipping_probe_every_in_a_row():
    r = TierReadRates()
    r.set("cpu", SLOW)
    cost = CostAdmission(r, probe_every=3)
    assert [cost.admit("cpu", 1 << 20, compute_ms=1.0) for _ in range(8)] == [False] * 3 + [True] + [False] * 3 + [True]
    with pytest.raises(ValueError, match="probe_every=0"):
        CostAdmission(r, probe_every=0)


def test_tier_admission_is_a_store_setting_checked_with_a_one_line_error():
    assert StoreConnectorConfig().tier_admission == "cost"
    s = settings_from_mapping({"store": {"tier_admission": "always"}})
    assert s.store.tier_admission == "always"
    with pytest.raises(ConnectorConfigError, match="tier_admission='sometimes' must be one of cost, always"):
        StoreConnectorConfig(tier_admission="sometimes")
    with pytest.raises(PicSettingsError, match="store.tier_admission"):
        settings_from_mapping({"store": {"tier_admission": "sometimes"}}, "f.toml")


def test_cpu_tier_hits_are_leased_before_the_nvme_hits_promotion_can_demote_them(start_daemon, store_engine):
    # room for two signatures in the CPU tier: promoting the NVMe hit would have to demote a
    # CPU-tier hit of the same request (which was then served from NVMe and timed as a CPU load)
    d = start_daemon(cpu_capacity="800KiB", nvme_capacity="64MiB")
    engine, planner = store_engine(d)
    run_one(engine, planner, prompt((0, 1, 2)), "cold")
    assert planner.store.flush()
    with d.client() as kv:
        keys = [o.key for o in kv.list()]
        assert len(keys) == 3 and all(o.size > 300_000 for o in kv.list())
        kv.evict("cpu")
        assert kv.prefetch(keys[:2], tier="cpu") == 2
        tiers = {e.key: e.tier for e in kv.lookup(keys)}
        assert sorted(tiers.values()) == ["cpu", "cpu", "nvme"]
        demotions = kv.stats()["demotions"]
    _, rep, st = run_one(engine, planner, prompt((0, 1, 2)), "warm")
    assert rep.hit_segments == 3 and st.hits_by_tier == {"gpu": 0, "cpu": 2, "nvme": 1}
    with d.client() as kv:
        assert kv.stats()["demotions"] == demotions  # no CPU-tier hit was pushed down to make room
        assert {e.key: e.tier for e in kv.lookup(keys)} == tiers
