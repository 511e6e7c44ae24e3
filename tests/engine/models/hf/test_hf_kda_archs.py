"""The Kimi Delta Attention architectures, Kimi-Linear (`kimi_linear`: KDA + multi-head
latent attention without RoPE + MoE) and Ling 3.0 (`bailing_hybrid`: KDA with full-rank and
bounded gates + MLA with RoPE and a head gate + MoE), on tiny random transformers
checkpoints: prefill logits and 16 greedy decode steps match transformers' own model within
1e-4 (fp32), also sharded and with the other MLA shapes; PIC with whole-segment seams equals
full recompute; signatures round-trip through a real kvstore daemon; config fields we do
not implement are refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402
from engine.pic.config import PicConfig  # noqa: E402

ARCH = "kimi_linear"
ARCHS = ["kimi_linear", "bailing_hybrid"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch) -> (transformers model, checkpoint dir), each built once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            d = tmp_path_factory.mktemp(arch)
            model, _ = H.build(arch, d)
            made[arch] = (model, d)
        return made[arch]
    return get


@pytest.fixture(scope="module")
def kimi(tiny):
    return tiny("kimi_linear")


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_matches_transformers_prefill_and_greedy_decode(tiny, arch):
    model, d = tiny(arch)
    H.assert_parity(H.check_parity(model, d, chunk=7))


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint_matches_transformers(tiny, arch, tmp_path):
    model, _ = tiny(arch)
    d = tmp_path / "sharded"
    d.mkdir()
    ids = H.train_tokenizer(d, with_bos=False)
    H.save_checkpoint(model, d, [ids["<|im_end|>"], ids["<|endoftext|>"]], shard=True)
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    H.assert_parity(H.check_parity(model, d))


@pytest.mark.parametrize("arch, extra", [("kimi_linear", {}), ("bailing_hybrid", {"kda_safe_gate": False})])
def test_mla_with_q_lora_and_values_wider_than_keys_matches_transformers(tmp_path, arch, extra):
    """The other MLA shapes: queries through q_a/q_a_layernorm/q_b, v_head_dim (32) above
    the key dims (24), so q and k carry the zero padding (Ling 3 also with Kimi's
    softplus forget gate instead of the bounded one)."""
    from engine.models.hf import load_hf_model

    model = H.tiny_model(arch, H.VOCAB, seed=3, q_lora_rank=8, v_head_dim=32, **extra)
    d = tmp_path / "qlora"
    H.save_checkpoint(model, d, [0])
    loaded = load_hf_model(d)
    a = loaded.config.attention
    assert (a.mla_q_lora_rank, a.head_dim, a.mla_v_dim) == (8, 32, 32)
    ids = torch.randint(0, H.VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0]
        ours = loaded.model.forward(ids)[0]
    assert float(ref.abs().max()) > 0.1
    torch.testing.assert_close(ours, ref, rtol=H.TOL, atol=H.TOL)


def test_kimi_linear_maps_kda_mla_and_the_grouped_router(kimi):
    from engine.models.hf import convert_checkpoint

    _, d = kimi
    cfg = convert_checkpoint(d).config
    assert cfg.layers == ("kda", "kda", "full", "kda")
    assert cfg.mlp_layers == ("dense", "moe", "moe", "moe")
    lin, a, m = cfg.linear, cfg.attention, cfg.moe
    assert (lin.num_heads, lin.num_v_heads, lin.key_dim, lin.value_dim, lin.conv_size, lin.conv_kinds) == (
        4, 4, 16, 16, 4, ("kda",))
    assert (a.mla_kv_lora_rank, a.mla_q_lora_rank, a.mla_nope_dim, a.mla_rope_dim, a.mla_v_dim) == (16, 0, 16, 8, 12)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.softmax_scale) == (4, 4, 24, 0, 24 ** -0.5)
    assert (m.num_experts, m.top_k, m.scoring, m.expert_bias, m.num_groups, m.topk_groups) == (
        8, 2, "sigmoid", True, 4, 2)
    assert (m.shared_intermediate_size, m.shared_expert_gate, m.routed_scaling_factor) == (32, False, 2.446)


def test_hub_linear_attn_config_gives_the_same_layers(kimi):
    """The published config's `linear_attn_config` (1-indexed kda_layers/full_attn_layers,
    head_dim, num_heads, short_conv_kernel_size) read as transformers reads it."""
    from engine.models.hf.fields import ConfigFields
    from engine.models.hf.kimi_linear import model_config

    _, d = kimi
    raw = json.loads((d / "config.json").read_text())
    for key in ("layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "mlp_layer_types"):
        raw.pop(key)
    raw["linear_attn_config"] = {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "head_dim": 16, "num_heads": 4,
                                 "short_conv_kernel_size": 4}
    raw["first_k_dense_replace"] = 1
    raw.update(mla_use_nope=True, rope_theta=10000.0, moe_router_activation_func="sigmoid", use_grouped_topk=True,
               moe_layer_freq=1, num_nextn_predict_layers=0)  # the published config's descriptive fields
    cfg = model_config(ConfigFields(raw, "config.json"), "hub")
    assert cfg.layers == ("kda", "kda", "full", "kda")
    assert cfg.mlp_layers == ("dense", "moe", "moe", "moe")
    raw["linear_attn_config"]["kda_gate_lower_bound"] = -5.0
    from engine.errors import ConfigError
    with pytest.raises(ConfigError, match="kda_gate_lower_bound"):
        model_config(ConfigFields(raw, "config.json"), "hub")


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(num_key_value_heads=2), "num_key_value_heads"),
    (lambda c: c.update(qk_head_dim=30), "qk_head_dim"),
    (lambda c: c.update(mlp_layer_types=["dense", "sparse", "moe", "sparse"]), "mlp_layer_types"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types"),
    (lambda c: c.update(mla_use_nope=False), "mla_use_nope"),
    (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
    (lambda c: c.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (lambda c: c.update(some_new_feature=3), "some_new_feature"),
])
def test_kimi_linear_config_fields_we_do_not_implement_are_refused_by_name(kimi, tmp_path, edit, named):
    from engine.errors import ConfigError
    from engine.models.hf import convert_checkpoint

    bad = _edited_copy(kimi[1], tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=named):
        convert_checkpoint(bad)


@pytest.mark.parametrize("arch, how", [("kimi_linear", dict(fused=True)), ("kimi_linear", dict(fused=False)),
                                       ("kimi_linear", dict(fused=True, seam_chain="on")),
                                       ("bailing_hybrid", dict(fused=True))],
                         ids=["kimi-fused", "kimi-stepwise", "kimi-chain-on", "ling3-fused"])
def test_pic_with_whole_segment_seams_equals_full_recompute(tiny, arch, how):
    """Also with the seam-chain kernel asked for: kda has none, its layers take the
    per-event path (the MLA layer is attention, unaffected)."""
    from engine.pic.planner import make_planner

    engine = H.new_engine(tiny(arch)[1])
    tok, runner = engine.tokenizer, engine.runner
    seam = max(len(tok.encode(d)) for d in H.DOCS)
    planner = make_planner(PicConfig(method="pic", seam=seam, miss_path="alone", **how), runner.model,
                           engine.loaded_model.fingerprint, tok)
    for n, order in enumerate([(0, 1, 2), (0, 2, 1)]):  # cold, then warm at new offsets
        request = H.make_request(tok, H.segments(order), f"r{n}")
        pic = H.execute_plan(planner, runner, request)
        full = H.full_logits(runner, request.prompt_token_ids)
        torch.testing.assert_close(pic, full, rtol=1e-4, atol=1e-4)
        report = planner.take_report(request.request_id)
        assert report.seam_tokens == sum(len(tok.encode(H.DOCS[i])) for i in order[1:])
        assert (report.hit_segments, report.miss_segments) == ((0, 1) if n == 0 else (1, 0))
        assert (report.reused_tokens > 0) == (n == 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_signatures_round_trip_through_a_real_daemon(tiny, arch, tmp_path):
    """A second engine hits every segment the first one stored (kda's dense transitions
    and the MLA layer's expanded K/V in the signature) and generates what in-process PIC
    generates."""
    H.check_signatures_round_trip(tiny(arch)[1], tmp_path)


def test_bf16_kimi_linear_keeps_its_decay_parameters_and_router_in_float32(kimi):
    from engine.models.hf import load_hf_model
    from engine.models.hf.checkpoint import CheckpointTensors

    _, d = kimi
    m = load_hf_model(d, dtype="bfloat16").model
    kda, moe = m.mixer(0), m.blocks[1].mlp
    assert kda.q_proj.weight.dtype == torch.bfloat16
    assert kda.dt_bias.dtype == kda.A_log.dtype == torch.float32
    assert torch.equal(kda.dt_bias, CheckpointTensors(d).take("model.layers.0.self_attn.dt_bias").float())
    assert moe.router.weight.dtype == moe.router_bias.dtype == torch.float32
    with torch.no_grad():
        logits = m.forward(torch.tensor([[1, 2, 3, 4, 5]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_ling3_maps_kda_gates_mla_rope_and_head_gate(tiny):
    from engine.models.hf import convert_checkpoint

    cfg = convert_checkpoint(tiny("bailing_hybrid")[1]).config
    assert cfg.layers == ("kda", "full") * 2  # layer_group_size 2
    assert cfg.mlp_layers == ("dense", "moe", "moe", "moe")  # first_k_dense_replace 1
    lin, a, m = cfg.linear, cfg.attention, cfg.moe
    assert (lin.key_dim, lin.num_heads, lin.kda_full_rank_gates, lin.kda_gate_lower_bound) == (16, 4, True, -5.0)
    assert (a.rotary_dim, a.rope_theta, a.mla_rope_dim, a.mla_head_gate, a.head_dim) == (8, 50000.0, 8, True, 24)
    assert (m.num_groups, m.topk_groups, m.routed_scaling_factor, m.shared_intermediate_size) == (4, 2, 2.5, 32)


def test_ling3_multi_token_prediction_layers_are_skipped_with_a_log_line(tiny, tmp_path, caplog):
    """Tensors of layers after num_hidden_layers (the MTP layers the hub checkpoint stores)
    are skipped, named in a log line, and the model is unchanged."""
    import logging

    from safetensors.torch import load_file, save_file

    from engine.models.hf import load_hf_model

    model, d = tiny("bailing_hybrid")
    mtp = tmp_path / "mtp"
    shutil.copytree(d, mtp)
    state = load_file(str(mtp / "model.safetensors"))
    state["model.layers.4.attention.q_proj.weight"] = torch.zeros(96, 64)
    state["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="engine.models.hf.loader"):
        loaded = load_hf_model(mtp)
    assert any("multi-token-prediction" in r.getMessage() and "2 tensors" in r.getMessage() for r in caplog.records)
    ids = torch.randint(0, H.VOCAB, (1, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.forward(ids)[0], model(input_ids=ids).logits[0], rtol=H.TOL,
                                   atol=H.TOL)


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(kda_lower_bound=1.0), "kda_lower_bound"),
    (lambda c: c.update(num_key_value_heads=1), "num_key_value_heads"),
    (lambda c: c.update(no_kda_lora=False), "no_kda_lora"),
    (lambda c: c.update(gated_attention_proj_granularity_type="element_wise"), "gated_attention_proj_granularity"),
    (lambda c: c.update(moe_shared_expert_intermediate_size=48), "moe_shared_expert_intermediate_size"),
    (lambda c: c.update(some_new_feature=3), "some_new_feature"),
])
def test_ling3_config_fields_we_do_not_implement_are_refused_by_name(tiny, tmp_path, edit, named):
    from engine.errors import ConfigError
    from engine.models.hf import convert_checkpoint

    bad = _edited_copy(tiny("bailing_hybrid")[1], tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=named):
        convert_checkpoint(bad)


@pytest.mark.parametrize("arch, conv_float32", [("kimi_linear", False), ("bailing_hybrid", True)])
def test_bf16_short_conv_computes_in_the_dtype_the_reference_keeps(tiny, arch, conv_float32):
    """Ling 3 keeps its conv weights float32 in a bf16 model and convolves in float32 (then
    casts); Kimi-Linear convolves in bf16: our conv (prefill and decode step) gives the
    reference function's bf16 result exactly in both."""
    import importlib
    import inspect

    from engine.models.hf import load_hf_model

    ref = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    conv_fn, update_fn = inspect.unwrap(ref.causal_conv1d_fn), inspect.unwrap(ref.causal_conv1d_update)
    conv = load_hf_model(tiny(arch)[1], dtype="bfloat16").model.mixer(0).conv
    assert conv.float32 == conv_float32
    assert conv.weight.dtype == (torch.float32 if conv_float32 else torch.bfloat16)
    x = torch.randn(1, 9, conv.channels, generator=torch.Generator().manual_seed(9)).bfloat16()
    ours, tail = conv(x)
    w = conv.weight.detach()
    want = conv_fn(x.transpose(1, 2), weight=w, bias=None, activation="silu").transpose(1, 2)
    assert ours.dtype == want.dtype == torch.bfloat16
    assert torch.equal(ours, want)
    step = torch.randn(1, conv.channels, generator=torch.Generator().manual_seed(10)).bfloat16()
    state = tail.to(w.dtype).clone()
    y, _ = conv.step(step, tail)
    want_step = update_fn(step[:, :, None], state, weight=w, bias=None, activation="silu")[:, :, 0]
    torch.testing.assert_close(y.float(), want_step.float(), rtol=0, atol=2 ** -7 * float(want_step.abs().max()))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("how", [dict(fused=True, miss_path="alone"), dict(fused=False, miss_path="alone"),
                                 dict(fused=True, miss_path="context", miss_signatures="context")],
                         ids=["fused", "stepwise", "captured-in-context"])
def test_kda_state_composition_is_exact_with_a_narrow_seam(tiny, arch, how):
    """The first kda layer sees the tokens' embeddings, so with a seam of conv width - 1 = 3
    tokens (what the short conv needs) its state after PIC is still exact: every segment's
    tail enters through its dense transition (S = T_tail S + E_tail), computed alone or
    captured in context by the cold pass; naive addition (S + E_tail) is not."""
    from engine.pic.planner import make_planner

    engine = H.new_engine(tiny(arch)[1])
    tok, runner = engine.tokenizer, engine.runner
    assert runner.model.mixer(0).family == "kda"
    planner = make_planner(PicConfig(method="pic", seam=3, **how), runner.model, engine.loaded_model.fingerprint,
                           tok)
    naive = make_planner(PicConfig(method="naive", seam=3, **how), runner.model, engine.loaded_model.fingerprint, tok)
    for n, order in enumerate([(0, 1, 2), (2, 0, 1)]):
        pic = H.first_layer_state(runner, H.make_request(tok, H.segments(order), f"r{n}"), planner)
        report = planner.take_report(f"r{n}")
        added = H.first_layer_state(runner, H.make_request(tok, H.segments(order), f"n{n}"), naive)
        full = H.first_layer_state(runner, H.make_request(tok, H.segments(order), f"f{n}"))
        assert float(full.abs().max()) > 1e-2
        assert float((pic - full).norm() / full.norm()) < 1e-5
        if n == 1:  # warm, every segment spliced: naive addition (no T) is far off
            assert float((added - full).norm() / full.norm()) > 1e-2
    assert report.hit_segments == 3 and report.reused_tokens > 0


def test_ling3_hub_config_fields_at_the_reference_values_load_the_same_model(tiny, tmp_path):
    from engine.models.hf import convert_checkpoint

    d = tiny("bailing_hybrid")[1]
    hub = _edited_copy(d, tmp_path / "hub", lambda c: c.update(
        no_kda_lora=True, rope_interleave=True, gated_attention_proj_granularity_type="head_wise",
        score_function="sigmoid", use_qk_norm=False, use_qkv_bias=False, moe_shared_expert_intermediate_size=32))
    assert convert_checkpoint(hub).config.replace(name="x") == convert_checkpoint(d).config.replace(name="x")
