"""ModelRunner on every tiny preset (fp32, CPU): prefill + decode equals the parallel forward,
chunked prefill equals single shot, a batch of mixed-length sequences decodes as each alone;
and the runner's misuse errors."""
from __future__ import annotations


import pytest
import torch

from engine.errors import CacheFullError, RuntimeStateError
from engine.models.presets import list_presets
from engine.runtime.sequence import Sequence

TOL = dict(rtol=1e-5, atol=5e-5)
TINY = [c.name for c in list_presets("tiny")]


def token_ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", TINY)
def test_preset_prefill_then_decode_equals_parallel_forward(preset, models, make_runner):
    model = models[preset]
    ids = token_ids(30, 0)
    with torch.no_grad():
        ref = model(ids[None])[0]
    runner = make_runner(model, block_size=4)
    seq = runner.cache.allocate(Sequence("a"))
    torch.testing.assert_close(runner.prefill(seq, ids[:13]), ref[12], **TOL)
    for t in range(13, 30):
        torch.testing.assert_close(runner.decode([seq], ids[t:t + 1])[0], ref[t], **TOL)


@pytest.mark.parametrize("preset", TINY)
def test_preset_chunked_prefill_equals_single_shot(preset, models, make_runner):
    model = models[preset]
    ids = token_ids(37, 1)
    one = make_runner(model, block_size=4)
    s1 = one.cache.allocate(Sequence("one"))
    ref = one.prefill(s1, ids, all_logits=True)
    for chunks in ([5, 9, 23], [1, 17, 19]):
        many = make_runner(model, block_size=4)
        s2 = many.cache.allocate(Sequence("many"))
        got, start = [], 0
        for n in chunks:
            got.append(many.prefill(s2, ids[start:start + n], all_logits=True))
            start += n
        torch.testing.assert_close(torch.cat(got), ref, **TOL)
        # and the next decode step agrees as well
        nxt = torch.tensor([7])
        torch.testing.assert_close(many.decode([s2], nxt), one.decode([s1], nxt), **TOL)
        one = make_runner(model, block_size=4)
        s1 = one.cache.allocate(Sequence("one"))
        one.prefill(s1, ids)


@pytest.mark.parametrize("preset", TINY)
def test_preset_batched_decode_of_mixed_lengths_equals_each_alone(preset, models, make_runner):
    model = models[preset]
    lengths = [3, 11, 20]
    steps = 5
    seqs_ids = [token_ids(n + steps, 10 + i) for i, n in enumerate(lengths)]
    runner = make_runner(model, block_size=4)
    seqs = [runner.cache.allocate(Sequence(f"s{i}")) for i in range(len(lengths))]
    for s, ids, n in zip(seqs, seqs_ids, lengths):
        runner.prefill(s, ids[:n])
    batched = []
    for t in range(steps):
        toks = torch.stack([ids[n + t] for ids, n in zip(seqs_ids, lengths)])
        batched.append(runner.decode(seqs, toks))
    for i, (ids, n) in enumerate(zip(seqs_ids, lengths)):
        alone = make_runner(model, block_size=4)
        s = alone.cache.allocate(Sequence("alone"))
        alone.prefill(s, ids[:n])
        for t in range(steps):
            torch.testing.assert_close(batched[t][i], alone.decode([s], ids[n + t:n + t + 1])[0], **TOL)


def test_freed_slot_is_reused_from_zero_state(models, make_runner):
    model = models["qwen3next-tiny"]
    runner = make_runner(model, num_slots=1)
    ids = token_ids(12, 3)
    a = runner.cache.allocate(Sequence("a"))
    first = runner.prefill(a, ids)
    runner.cache.free(a)
    b = runner.cache.allocate(Sequence("b"))
    assert b.slot == 0
    torch.testing.assert_close(runner.prefill(b, ids), first)


def test_runner_rejects_noncontiguous_chunks_empty_chunks_and_full_pools(models, make_runner):
    model = models["gemma3-tiny"]
    runner = make_runner(model, block_size=4, num_blocks=3)
    seq = runner.cache.allocate(Sequence("a"))
    runner.prefill(seq, token_ids(5, 0))
    with pytest.raises(RuntimeStateError, match="start_pos=2"):
        runner.prefill(seq, token_ids(3, 1), start_pos=2)
    with pytest.raises(RuntimeStateError, match="non-empty"):
        runner.prefill(seq, [])
    with pytest.raises(CacheFullError, match="KV blocks"):
        runner.prefill(seq, token_ids(20, 2))
    assert seq.num_computed_tokens == 5
    with pytest.raises(RuntimeStateError, match="one token per sequence"):
        runner.decode([seq], [1, 2])
    with pytest.raises(RuntimeStateError, match="same sequence twice"):
        runner.decode([seq, seq], [1, 2])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 260\)"):
        runner.prefill(seq, [300])


@pytest.mark.parametrize("preset", ["qwen3next-tiny", "nemotronh-tiny"])
def test_one_scratch_prefill_yields_a_segments_linear_summary(preset, models, make_runner):
    """The PIC workflow: prefill a segment alone; the hook's inputs give each linear layer's
    (T, E, conv tail) and E / tail equal what the state slots now hold."""
    from engine.models.layers.linear_base import LinearMixer

    model = models[preset]
    runner = make_runner(model)
    seq = runner.cache.allocate(Sequence("segment"))
    inputs = {}
    runner.prefill(seq, token_ids(21, 5), mixer_input_hook=lambda i, h: inputs.__setitem__(i, h.clone()))
    linear = [i for i, b in enumerate(model.blocks) if isinstance(b.mixer, LinearMixer)]
    assert linear and set(linear) <= set(inputs)
    for i in linear:
        with torch.no_grad():
            summary = model.mixer(i).summarize_segment(inputs[i])
        cache = runner.cache.layer(i)
        torch.testing.assert_close(summary.end_state, cache.get_state(seq.slot), **TOL)
        torch.testing.assert_close(summary.conv_tail, cache.get_conv_tail(seq.slot))
        assert summary.transition.shape == ((4, 32, 32) if preset.startswith("qwen") else (8,))
