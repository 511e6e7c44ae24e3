"""With top-k covering every block, HiSparse decoding is dense decoding on every tiny preset:
same greedy tokens, logits within float tolerance, for a batch of two sequences of
different lengths after chunked prefill. Once with a hot buffer that holds every block,
once with a tiny hot buffer (2 blocks: the sink and the current one), where blocks are
evicted and read back from the block store every step."""
import pytest

from engine.hisparse import HiSparseConfig
from engine.models.presets import list_presets
from hisparse_testlib import assert_same_run, dense_runner, greedy, hisparse_runner, random_prompts, tiny_model

TINY = [c.name for c in list_presets() if c.name.endswith("-tiny")]
STEPS = 10


def test_every_tiny_preset_is_covered():
    assert set(TINY) >= {"qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny", "gla-tiny"}


@pytest.mark.parametrize("preset", TINY)
def test_hisparse_with_all_blocks_selected_equals_dense_with_large_and_tiny_hot_buffers(preset):
    model = tiny_model(preset)
    prompts = random_prompts([45, 70], seed=len(preset))
    want = greedy(dense_runner(model), prompts, STEPS)
    large = HiSparseConfig(enabled=True, block_size=8, topk=64, hot_blocks=16, min_context=0)
    runner, off = hisparse_runner(model, large)
    assert_same_run(greedy(runner, prompts, STEPS), want)
    snap = off.snapshot()
    assert snap["blocks_fetched"] == 0 and snap["hot_hit_rate"] == 1.0  # everything stayed resident

    tiny = HiSparseConfig(enabled=True, block_size=8, topk=64, hot_blocks=2, min_context=0)
    runner, off = hisparse_runner(model, tiny)
    assert_same_run(greedy(runner, prompts, STEPS), want)
    snap = off.snapshot()
    assert snap["blocks_evicted"] > 0 and snap["blocks_fetched"] > 0 and snap["blocks_staged"] > 0
    assert snap["hot_hit_rate"] < 0.5
