"""The synthetic load behind `kvengine bench`: exact token accounting under Poisson
arrivals on a tiny preset, and the percentile rule of its report."""
import pytest
import torch

from engine.bench import LoadSpec, percentile, run_load
from engine.builder import EngineConfig, build_engine
from engine.errors import InvalidRequestError


def test_percentile_interpolates_between_order_statistics():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert percentile([7.0], 99) == 7.0


def test_poisson_load_runs_every_request_to_its_token_count():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = build_engine("nemotronh-tiny", EngineConfig(device="cpu", dtype="float32", max_num_seqs=2,
                                                             kv_cache_tokens=256))
        rep = run_load(engine, LoadSpec(num_requests=5, prompt_len=12, max_new_tokens=3, request_rate=40.0, seed=3))
    finally:
        torch.set_num_threads(threads)
    assert (rep.num_requests, rep.prompt_tokens, rep.output_tokens) == (5, 60, 15)
    assert 0 < rep.ttft_ms_p50 <= rep.ttft_ms_p99 <= rep.e2e_ms_p99
    assert rep.duration_s > 0 and rep.output_tokens_per_s == pytest.approx(15 / rep.duration_s)
    assert engine.cache_usage() == 0.0


def test_load_spec_names_the_bad_field():
    with pytest.raises(InvalidRequestError, match="prompt_len"):
        LoadSpec(prompt_len=0).validate()
