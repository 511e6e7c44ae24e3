"""Tiny Hugging Face checkpoints for the loader tests: a random transformers model of a
given architecture saved with `save_pretrained` (optionally sharded) next to a small BPE
tokenizer trained here with `tokenizers`, a chat template and a generation config.

transformers is a test-only dependency (the `dev` extra); the engine never imports it.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Position independent caching reuses each segment wherever it appears.",
    "Hybrid models mix linear attention with a few full attention layers.",
    "Retrieved documents, tool outputs and a system prompt recur across requests.",
    "hello world, hello cache, hello daemon; numbers 0 1 2 3 4 5 6 7 8 9",
] * 4

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>"]
VOCAB = 300


def train_tokenizer(directory: Path, with_bos: bool) -> dict:
    """A byte-level BPE tokenizer of VOCAB ids written as tokenizer.json +
    tokenizer_config.json; with_bos adds `<bos>` in front of every default encoding (as
    Gemma's / Llama's post-processors do). Returns the special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", ids["<bos>"])])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>" if with_bos else None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))
    return ids


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter N(0, 0.02)-perturbed from its init (norm weights away from their
    defaults, so a wrong norm convention shows), A_log kept in a sane range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g) * (0.2 if "norm" in name else 0.05)
            p.add_(noise.to(p.dtype))


def save_checkpoint(model, directory: Path, eos_ids: list[int], shard: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), max_shard_size="40KB" if shard else "5GB")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids, "do_sample": False}))
    return directory


REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"
MODELING = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3", "nemotron_h", "kimi_linear", "bailing_hybrid"]


def import_reference_modeling() -> None:
    """Import transformers' modeling modules with fla hidden, so their linear-attention
    functions bind to transformers' own torch implementations (the reference), not to fla's
    Triton kernels, which transformers would pick when fla is installed (no GPU here)."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # import fla -> ImportError
    try:
        for name in MODELING:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def bailing_reference():
    """tests/engine/models/reference/bailing_moe_linear_v2.py (Ring-linear-2.0 in plain torch:
    transformers has no class for it)."""
    if str(REFERENCE_DIR) not in sys.path:
        sys.path.insert(0, str(REFERENCE_DIR))
    return importlib.import_module("bailing_moe_linear_v2")


def tiny_bailing(vocab: int, seed: int = 0, **fields):
    """The reference Ring-linear-2.0 model with a tiny random config (fp32, eval mode): 6
    layers (L L F L L F), partial RoPE, q/k norm, group norm over 2 groups, 8 experts in 4
    groups (top-2 groups, top-2 experts), a dense first layer, a shared expert, a random
    expert bias."""
    ref = bailing_reference()
    torch.manual_seed(seed)
    model = ref.BailingMoeLinearV2ForCausalLM(ref.BailingMoeLinearV2Config(vocab_size=vocab, **fields))
    randomize(model, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.expert_bias.copy_(torch.randn(gate.expert_bias.shape, generator=g) * 0.05)
    return model.float().eval()


def tiny_model(arch: str, vocab: int, seed: int = 0, **fields):
    """A transformers model of `arch` with a tiny random config (fp32, eval mode); `fields`
    override the config (kimi_linear only)."""
    if arch == "bailing_moe_linear":
        return tiny_bailing(vocab, seed)
    import_reference_modeling()
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "qwen3_next":
        cfg = tf.Qwen3NextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
            mlp_only_layers=[1], max_position_embeddings=512)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif arch == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
            tie_word_embeddings=True)
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif arch == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=512)
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            max_position_embeddings=512,
            layer_types=["sliding_attention"] * 5 + ["full_attention"])
        model = tf.Gemma3ForCausalLM(cfg)
    elif arch == "nemotron_h":
        cfg = tf.NemotronHConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
            max_position_embeddings=512, chunk_size=16,
            layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                               "linear_attention", "linear_attention", "mlp"])
        model = tf.NemotronHForCausalLM(cfg)
    elif arch == "kimi_linear":
        cfg = tf.KimiLinearConfig(**{**KIMI_FIELDS, **fields})
        model = tf.KimiLinearForCausalLM(cfg)
    elif arch == "bailing_hybrid":
        cfg = tf.BailingHybridConfig(**{**LING3_FIELDS, **fields})
        model = tf.BailingHybridForCausalLM(cfg)
    else:
        raise ValueError(arch)
    randomize(model, seed + 1)
    if arch in ("kimi_linear", "bailing_hybrid"):
        with torch.no_grad():  # the router's choice bias is a buffer: give it values too
            g = torch.Generator().manual_seed(seed + 2)
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.05)
    return model.float().eval()


#: the tiny Kimi-Linear: KDA, KDA, MLA, KDA (the MLA with NoPE, v_head_dim != qk dims, no
#: q LoRA), a dense first MLP, then MoE with 8 experts in 4 groups (top-2 groups, top-2
#: experts) and a shared expert
KIMI_FIELDS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    n_shared_experts=1, linear_head_dim=16, linear_num_heads=4, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    max_position_embeddings=512,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
#: the tiny Ling 3 (bailing_hybrid): KDA (full-rank gates, safe gate), MLA with RoPE on the
#: shared part and a head gate, every second layer (L F L F), one dense MLP then MoE
LING3_FIELDS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    n_shared_experts=1, head_dim=16, layer_group_size=2, first_k_dense_replace=1, pad_token_id=0,
    eos_token_id=None, max_position_embeddings=512, rope_theta=50000.0, num_mtp_layers=0)


def build(arch: str, directory: Path, shard: bool = False, seed: int = 0, with_bos: bool | None = None):
    """Tokenizer + tiny model of `arch` saved under `directory`; returns (model, special ids)."""
    directory.mkdir(parents=True, exist_ok=True)
    bos = arch == "gemma3" if with_bos is None else with_bos
    ids = train_tokenizer(directory, bos)
    model = tiny_model(arch, VOCAB, seed)
    save_checkpoint(model, directory, [ids["<|im_end|>"], ids["<|endoftext|>"]], shard)
    return model, ids


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """transformers' own prefill logits `[T, V]`, then `steps` greedy decode steps with its
    cache: (prefill logits, each step's logits, generated ids)."""
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    prefill = out.logits[0]
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    nxt = int(prefill[-1].argmax())
    gen, step_logits = [nxt], []
    for _ in range(steps):
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        step_logits.append(out.logits[0, -1])
        nxt = int(out.logits[0, -1].argmax())
        gen.append(nxt)
    return prefill, step_logits, gen


PROMPT = "Hybrid models mix linear attention with a few full attention layers, hello cache 0 1 2 3"
DECODE_STEPS = 16
TOL = 1e-4


@torch.no_grad()
def check_parity(reference, directory: Path, chunk: int | None = None) -> dict:
    """Our engine on `directory` against transformers' `reference`: prefill logits of the
    tokenizer's default encoding of PROMPT (in chunks of `chunk` tokens when given, so the
    cached path is exercised), then DECODE_STEPS greedy steps, each step's logits within
    TOL. Returns figures for the assertion messages."""
    from engine.builder import EngineConfig, build_engine
    from engine.runtime.sequence import Sequence

    engine = build_engine(str(directory), EngineConfig(device="cpu", dtype="float32", max_num_seqs=2,
                                                       kv_cache_tokens=512))
    prompt_ids = engine.tokenizer.encode_default(PROMPT)
    ref_prefill, ref_steps, ref_gen = reference_greedy(reference, prompt_ids, DECODE_STEPS)
    runner = engine.runner
    seq = Sequence("parity")
    runner.cache.allocate(seq)
    step = chunk or len(prompt_ids)
    parts = [runner.prefill(seq, prompt_ids[a:a + step], all_logits=True) for a in range(0, len(prompt_ids), step)]
    ours_prefill = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
    prefill_err = float((ours_prefill - ref_prefill).abs().max())
    nxt = int(ours_prefill[-1].argmax())
    gen, step_errs = [nxt], []
    for ref_logits in ref_steps:
        logits = runner.decode([seq], [nxt])[0]
        step_errs.append(float((logits - ref_logits).abs().max()))
        nxt = int(logits.argmax())
        gen.append(nxt)
    runner.cache.free(seq)
    return {"engine": engine, "prompt_ids": prompt_ids, "prefill_err": prefill_err, "step_errs": step_errs,
            "gen": gen, "ref_gen": ref_gen, "logit_scale": float(ref_prefill.abs().max())}


DOCS = [
    "Retrieved documents, tool outputs and a system prompt recur across requests. ",
    "The quick brown fox jumps over the lazy dog; hello world 4 5 6. ",
    "Position independent caching reuses each segment wherever it appears, hello daemon. ",
]
QUESTION = "Hybrid models mix linear attention with"


def segments(order) -> list[dict]:
    """Cached DOCS in `order`, then the uncached QUESTION."""
    return [{"text": DOCS[i], "cache": True} for i in order] + [{"text": QUESTION, "cache": False}]


def make_request(tokenizer, segs: list[dict], request_id: str):
    """A Request as the engine builds it (anchor, then each segment tokenized alone)."""
    from engine.runtime.request import PromptSegment, Request
    from engine.runtime.sampling import SamplingParams

    ids = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    parts = []
    for s in segs:
        toks = tokenizer.encode(s["text"])
        parts.append(PromptSegment(s["text"], s["cache"], len(ids), len(ids) + len(toks)))
        ids.extend(toks)
    return Request(request_id, ids, parts, SamplingParams())


@torch.no_grad()
def execute_plan(planner, runner, request) -> torch.Tensor:
    """Run `planner`'s plan for `request` as the engine does; the last position's logits."""
    from engine.runtime.planner import ApplyStep, FusedStep
    from engine.runtime.sequence import Sequence

    plan = request.plan = planner.plan(request)
    request.seq = runner.cache.allocate(Sequence(request.request_id))
    runner.cache.ensure_capacity(request.seq, plan.num_tokens)
    ids = request.prefill_token_ids()
    logits = None
    for step in plan.steps:
        if isinstance(step, FusedStep):
            logits = step.run(runner, request)
        elif isinstance(step, ApplyStep):
            step.apply(runner, request)
        else:
            logits = runner.prefill(request.seq, ids[step.start:step.end], start_pos=step.start)
    planner.on_prefill_done(request)
    runner.cache.free(request.seq)
    return logits.reshape(-1, logits.shape[-1])[-1]


@torch.no_grad()
def full_logits(runner, ids: list[int]) -> torch.Tensor:
    from engine.runtime.sequence import Sequence

    seq = runner.cache.allocate(Sequence("full"))
    logits = runner.prefill(seq, ids)
    runner.cache.free(seq)
    return logits


def build_multimodal(arch: str, directory: Path, seed: int = 0):
    """A tiny multimodal checkpoint (`qwen3_5`: Qwen3_5ForConditionalGeneration; `gemma3`:
    Gemma3ForConditionalGeneration; each a text model + a one-block vision tower) and its
    tokenizer under `directory`; returns the transformers model."""
    import_reference_modeling()
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "qwen3_5":
        text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    max_position_embeddings=512)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=1, num_position_embeddings=16)
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision))
    elif arch == "gemma3":
        text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                    sliding_window=8, max_position_embeddings=512,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"])
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4)
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3))
    else:
        raise ValueError(arch)
    randomize(model, seed + 1)
    directory.mkdir(parents=True, exist_ok=True)
    ids = train_tokenizer(directory, with_bos=arch == "gemma3")
    save_checkpoint(model.float().eval(), directory, [ids["<|im_end|>"]])
    return model.float().eval()


ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3", "nemotron_h", "bailing_moe_linear"]


def new_engine(directory):
    """An engine on a checkpoint directory (CPU, fp32)."""
    from engine.builder import EngineConfig, build_engine

    return build_engine(str(directory), EngineConfig(device="cpu", dtype="float32", max_num_seqs=2,
                                                     kv_cache_tokens=2048))


def assert_parity(r: dict) -> None:
    """The verdict on a `check_parity` record: prefill and every decode step within TOL, the
    same greedy text, and reference logits that are not all ~0 (a vacuous match)."""
    assert r["logit_scale"] > 0.1
    assert r["prefill_err"] <= TOL, r["prefill_err"]
    assert len(r["step_errs"]) == DECODE_STEPS
    assert max(r["step_errs"]) <= TOL, r["step_errs"]
    assert r["gen"] == r["ref_gen"]


def run_request(engine, segs, request_id: str, max_new_tokens: int = 4):
    """Run one greedy request (`segs`, ignoring EOS) through `engine` to its finished output."""
    from engine.runtime.sampling import SamplingParams

    engine.add_request(segs, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), request_id=request_id)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


@torch.no_grad()
def first_layer_state(runner, request, planner=None):
    """The first layer's recurrent state after prefilling `request` by `planner`'s plan (or
    by a plain full prefill when None)."""
    from engine.runtime.planner import ApplyStep, FusedStep
    from engine.runtime.sequence import Sequence

    seq = request.seq = runner.cache.allocate(Sequence(request.request_id + ("-full" if planner is None else "")))
    ids = request.prefill_token_ids()
    if planner is None:
        runner.prefill(seq, ids)
    else:
        plan = request.plan = planner.plan(request)
        runner.cache.ensure_capacity(seq, plan.num_tokens)
        for step in plan.steps:
            if isinstance(step, FusedStep):
                step.run(runner, request)
            elif isinstance(step, ApplyStep):
                step.apply(runner, request)
            else:
                runner.prefill(seq, ids[step.start:step.end], start_pos=step.start)
        planner.on_prefill_done(request)
    state = runner.cache.layers[0].state[seq.slot].clone()
    runner.cache.free(seq)
    return state


def check_signatures_round_trip(d, root) -> None:
    """Signatures of checkpoint `d` through a real daemon under `root`: a first engine stores
    every segment of one prompt, a second engine (same fingerprint, only the daemon holds
    them) hits all three from the CPU tier in another order and generates what in-process
    PIC generates."""
    from engine.connector.attach import attach_store
    from engine.connector.config import StoreConnectorConfig
    from engine.pic.config import PicConfig
    from engine.pic.run import attach_planner
    from kvstore.testing import DaemonProcess

    prompts = [segments((0, 1, 2)), segments((2, 1, 0))]
    memory = new_engine(d)
    attach_planner(memory, PicConfig(miss_path="alone"))
    want = [run_request(memory, p, f"ref{i}").token_ids for i, p in enumerate(prompts)]

    daemon = DaemonProcess(Path(root) / "d", entry="kvstore.server").start()
    planners = []
    try:
        cfg = StoreConnectorConfig(socket=str(daemon.socket), rpc_timeout_s=5.0)
        first = new_engine(d)
        planners.append(attach_store(first, PicConfig(miss_path="alone"), cfg))
        assert run_request(first, prompts[0], "a").token_ids == want[0]
        assert planners[0].take_report("a").miss_segments == 3
        assert planners[0].store.flush()
        second = new_engine(d)  # another engine: only the daemon holds the signatures
        planners.append(attach_store(second, PicConfig(miss_path="alone"), cfg))
        assert second.loaded_model.fingerprint == first.loaded_model.fingerprint
        out = run_request(second, prompts[1], "b")
        report, store = planners[1].take_report("b"), planners[1].take_store_report("b")
        assert report.hit_segments == 3 and report.miss_segments == 0
        assert store.hits_by_tier["cpu"] == 3 and store.computed == 0
        assert out.token_ids == want[1]
    finally:
        for p in planners:
            p.store.close(timeout=10.0)
        daemon.cleanup()
