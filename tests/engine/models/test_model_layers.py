"""Every layer kind, in a small two-layer model: the cached prefill / chunked prefill / decode
paths equal the cache-free parallel forward, and the caches hold exactly what the maths
needs (paged K/V at their positions, the ring's last w tokens, the naive loop's state)."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, GLA, LIGHTNING, MAMBA2, SWA
from engine.models.layers.linear_ops import naive_recurrence
from engine.runtime.sequence import Sequence

KINDS = [FULL, SWA, GDN, GLA, LIGHTNING, MAMBA2]
TOL = dict(rtol=1e-5, atol=5e-5)
N = 29


def ids_for(cfg, n=N, seed=0):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def mixer_inputs(model, ids):
    """Each layer's normalised mixer input of a cache-free pass over ids (positions 0..n-1)."""
    seen = {}
    with torch.no_grad():
        model(ids[None], mixer_input_hook=lambda i, h: seen.__setitem__(i, h[0]))
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_token_by_token_decode_equals_parallel_forward(kind, make_config, make_model, make_runner):
    cfg = make_config([kind, kind])
    model = make_model(cfg)
    ids = ids_for(cfg)
    with torch.no_grad():
        ref = model(ids[None])[0]
    runner = make_runner(model)
    seq = runner.cache.allocate(Sequence("s"))
    first = runner.prefill(seq, ids[:9])
    torch.testing.assert_close(first, ref[8], **TOL)
    for t in range(9, N):
        out = runner.decode([seq], ids[t:t + 1])
        torch.testing.assert_close(out[0], ref[t], **TOL)
    assert seq.num_computed_tokens == N


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunks", [[1] * 6 + [23], [3, 5, 7, 14], [11, 18]])
def test_chunked_prefill_equals_single_shot(kind, chunks, make_config, make_model, make_runner):
    cfg = make_config([kind, kind])
    model = make_model(cfg)
    ids = ids_for(cfg, seed=1)
    one = make_runner(model)
    s1 = one.cache.allocate(Sequence("one"))
    ref = one.prefill(s1, ids, all_logits=True)
    many = make_runner(model)
    s2 = many.cache.allocate(Sequence("many"))
    outs, start = [], 0
    for n in chunks:
        outs.append(many.prefill(s2, ids[start:start + n], start_pos=start, all_logits=True))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, **TOL)
    # caches end up the same too
    for layer, (c1, c2) in enumerate(zip(one.cache.layers, many.cache.layers)):
        if kind == FULL:
            p1, p2 = one.cache.flat_slots(s1, 0, N), many.cache.flat_slots(s2, 0, N)
            torch.testing.assert_close(c2.gather(p2)[0], c1.gather(p1)[0], **TOL)
            torch.testing.assert_close(c2.gather(p2)[1], c1.gather(p1)[1], **TOL)
        elif kind == SWA:
            torch.testing.assert_close(c2.k[s2.slot], c1.k[s1.slot], **TOL)
            torch.testing.assert_close(c2.v[s2.slot], c1.v[s1.slot], **TOL)
        else:
            torch.testing.assert_close(c2.state[s2.slot], c1.state[s1.slot], **TOL)
            if c1.conv_tail is not None:
                torch.testing.assert_close(c2.conv_tail[s2.slot], c1.conv_tail[s1.slot], **TOL)


@pytest.mark.parametrize("kind", [FULL, SWA])
def test_attention_caches_hold_rotated_keys_and_values_at_their_positions(kind, make_config, make_model, make_runner):
    cfg = make_config([kind, kind])
    model = make_model(cfg)
    ids = ids_for(cfg, seed=2)
    runner = make_runner(model)
    seq = runner.cache.allocate(Sequence("s"))
    runner.prefill(seq, ids[:13])
    runner.prefill(seq, ids[13:])
    inputs = mixer_inputs(model, ids)
    pos = torch.arange(N)
    for layer in range(2):
        mixer = model.mixer(layer)
        with torch.no_grad():
            _, k, v, _ = mixer.project(inputs[layer], pos)
        cache = runner.cache.layer(layer)
        if kind == FULL:
            k_c, v_c = cache.gather(runner.cache.flat_slots(seq, 0, N))
            torch.testing.assert_close(k_c, k, **TOL)
            torch.testing.assert_close(v_c, v, **TOL)
        else:
            w = cfg.attention.sliding_window
            last = pos[-w:]
            k_c, v_c = cache.read(seq.slot, last)
            torch.testing.assert_close(k_c, k[-w:], **TOL)
            torch.testing.assert_close(v_c, v[-w:], **TOL)
            # ring index p % w holds position p: the ring is exactly the last w tokens
            torch.testing.assert_close(cache.k[seq.slot][last % w], k[-w:], **TOL)


def test_base_zero_keys_rerotated_equal_keys_at_true_position(make_config, make_model):
    model = make_model(make_config([FULL]))
    mixer = model.mixer(0)
    x = torch.randn(7, 32)
    with torch.no_grad():
        _, k0, _, _ = mixer.project(x, torch.arange(7))
        _, k_true, _, _ = mixer.project(x, torch.arange(7) + 40)
        torch.testing.assert_close(mixer.rope_shift(k0, 40), k_true, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [GDN, GLA, LIGHTNING, MAMBA2])
def test_state_slot_equals_naive_loop_state_and_conv_tail_is_last_inputs(kind, make_config, make_model, make_runner):
    lin = make_config([kind]).linear
    cfg = make_config([kind, kind], linear=type(lin)(**{**lin.__dict__, "conv_kinds": (GDN, MAMBA2, GLA, LIGHTNING)}))
    model = make_model(cfg)
    ids = ids_for(cfg, seed=3)
    runner = make_runner(model)
    seq = runner.cache.allocate(Sequence("s"))
    runner.prefill(seq, ids[:10])
    for t in range(10, N):
        runner.decode([seq], ids[t:t + 1])
    inputs = mixer_inputs(model, ids)
    for layer in range(2):
        mixer = model.mixer(layer)
        with torch.no_grad():
            conv_in, extras = mixer.project(inputs[layer][None])
            conv_out, tail = mixer.apply_conv(conv_in, None)
            _, state = naive_recurrence(mixer.family, mixer.prepare(conv_out, extras))
        cache = runner.cache.layer(layer)
        torch.testing.assert_close(cache.get_state(seq.slot), state[0], **TOL)
        width = mixer.conv.width
        torch.testing.assert_close(cache.get_conv_tail(seq.slot), conv_in[0, -(width - 1):].t(), **TOL)
        torch.testing.assert_close(tail[0], conv_in[0, -(width - 1):].t())


def test_sliding_window_attends_only_within_the_window(make_config, make_model):
    """Changing a token more than w positions back leaves a sliding-window layer's output unchanged."""
    cfg = make_config([SWA])
    model = make_model(cfg)
    mixer = model.mixer(0)
    w = cfg.attention.sliding_window
    x = torch.randn(1, 20, cfg.hidden_size)
    y = x.clone()
    y[0, 19 - w] += 1.0  # the token just outside the last query's window
    with torch.no_grad():
        a, b = mixer.forward_train(x), mixer.forward_train(y)
    torch.testing.assert_close(a[0, -1], b[0, -1])
    assert not torch.allclose(a[0, 19 - w], b[0, 19 - w])


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_forward_is_differentiable_for_training(kind, make_config, make_model):
    model = make_model(make_config([kind]))
    ids = ids_for(model.config, n=20)
    logits = model(ids[None, :-1])
    loss = torch.nn.functional.cross_entropy(logits[0], ids[1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]
    assert any(float(g.abs().sum()) > 0 for n, g in grads.items() if ".mixer." in n)


@pytest.mark.parametrize("kind", [GDN, GLA, LIGHTNING, MAMBA2])
def test_segment_summaries_compose_to_the_state_of_the_whole_sequence(kind, make_config, make_model):
    """S(whole) = T_2 (T_1 * 0 + E_1) + E_2 when the second segment's layer inputs are the same
    as in the whole pass (first linear layer, conv tail of segment 1 fed in)."""
    from engine.models.layers.linear_ops import apply_transition

    cfg = make_config([kind])
    model = make_model(cfg)
    mixer = model.mixer(0)
    h = torch.randn(30, cfg.hidden_size)
    with torch.no_grad():
        s1 = mixer.summarize_segment(h[:12])
        # segment 2 with segment 1's conv tail in front (what PIC feeds at splice time)
        conv_in, extras = mixer.project(h[None, 12:])
        tail = None if s1.conv_tail is None else s1.conv_tail[None]
        conv_out, _ = mixer.apply_conv(conv_in, tail)
        inp2 = mixer.prepare(conv_out, extras)
        t2 = mixer.transition_operator(inp2)[0]
        e2 = mixer.run_recurrence(inp2, None, "torch")[1][0]
        whole = mixer.summarize_segment(h)
    composed = apply_transition(mixer.family, t2[None], s1.end_state[None])[0] + e2
    torch.testing.assert_close(composed, whole.end_state, rtol=1e-5, atol=1e-5)


def test_rope_is_rotate_half_on_the_first_rotary_dims_only():
    from engine.models.layers.rope import apply_rope, rope_inv_freq

    x = torch.randn(3, 2, 10)  # [T, H, D], rotary_dim 6
    pos = torch.tensor([0, 5, 1000])
    inv = rope_inv_freq(6, 10000.0)
    out = apply_rope(x, pos, inv)
    half = 3
    for t, p in enumerate(pos.tolist()):
        for i in range(half):
            f = 10000.0 ** (-2 * i / 6)
            c, s = torch.cos(torch.tensor(p * f)), torch.sin(torch.tensor(p * f))
            torch.testing.assert_close(out[t, :, i], x[t, :, i] * c - x[t, :, i + half] * s)
            torch.testing.assert_close(out[t, :, i + half], x[t, :, i + half] * c + x[t, :, i] * s)
    assert torch.equal(out[..., 6:], x[..., 6:])


def test_bf16_model_keeps_float32_rope_frequencies(make_config):
    from engine.models.weights import build_model

    model = build_model(make_config([FULL]), dtype="bfloat16")
    assert model.mixer(0).inv_freq.dtype == torch.float32
    assert not list(model.named_buffers())


@pytest.mark.parametrize("rotary_dim", [0, 8])
def test_attention_variants_without_qk_norm_and_with_gqa_match_forward(rotary_dim, make_config, make_model,
                                                                       make_runner):
    import dataclasses

    base = make_config([FULL])
    attn = dataclasses.replace(base.attention, qk_norm=False, output_gate=True, rotary_dim=rotary_dim,
                               num_heads=6, num_kv_heads=2)
    cfg = make_config([FULL, SWA], attention=attn)
    model = make_model(cfg)
    ids = ids_for(cfg, n=12)
    with torch.no_grad():
        ref = model(ids[None])[0]
    runner = make_runner(model)
    seq = runner.cache.allocate(Sequence("s"))
    runner.prefill(seq, ids[:4])
    for t in range(4, 12):
        torch.testing.assert_close(runner.decode([seq], ids[t:t + 1])[0], ref[t], **TOL)


def test_prefill_attention_on_cuda_never_picks_cudnn_sdpa():
    # cuDNN's SDPA builds a plan per new sequence length (12-14 ms of host time per call on
    # the H200 when every request has its own length): the engine leaves it out on CUDA
    from engine.models.layers import attention

    if attention.sdpa_kernel is None:
        pytest.skip("this torch has no torch.nn.attention.sdpa_kernel")
    from torch.nn.attention import SDPBackend

    assert SDPBackend.CUDNN_ATTENTION not in attention.CUDA_SDPA_BACKENDS
    assert SDPBackend.FLASH_ATTENTION in attention.CUDA_SDPA_BACKENDS


def test_short_conv_valid_over_ranges_laid_out_behind_their_tails_equals_forward_with_each_tail():
    # fused PIC convolves every computed range in one call, each behind its own tail
    from engine.models.layers.conv import ShortConv

    g = torch.Generator().manual_seed(3)
    conv = ShortConv(6, 4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(6, 4, generator=g))
    xs = [torch.randn(1, n, 6, generator=g) for n in (5, 1, 9)]
    tails = [torch.randn(1, 6, 3, generator=g) for _ in xs]
    packed = torch.cat([t for pair in zip(tails, xs) for t in (pair[0][0], pair[1][0].T)], dim=1)
    y = conv.valid(packed)  # output i sees inputs [i, i + 4)
    at = 0
    for x, t in zip(xs, tails):
        want, _ = conv(x, t)
        n = x.shape[1]
        torch.testing.assert_close(y[:, at:at + n].T, want[0], rtol=1e-6, atol=1e-6)
        at += 3 + n
