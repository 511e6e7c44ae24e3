"""`kvengine`: the engine's command line (typer). Entry point `main`; also runnable as
`python -m engine.cli`.

    kvengine serve --preset NAME [--host H --port P --device D --dtype T --max-batch N ...]
    kvengine generate --preset NAME "PROMPT" [--max-new-tokens N --temperature T --top-p P --seed S]
    kvengine generate --model DIR "PROMPT" [--chat] --max-new-tokens N --json
    kvengine presets [--json]
    kvengine bench --preset NAME [--num-requests N --prompt-len L --max-new-tokens M --request-rate R --json]
    kvengine run --preset NAME --requests FILE.jsonl --method full|prefix|naive|pic [--seam N] [--max-new-tokens N] [--json] [--store [SOCKET]]
    kvengine serve ... [--store [SOCKET]] [--share-cold/--no-share-cold]
    kvengine run|serve ... [--miss-path alone|context] [--miss-signatures alone|context]

`--model DIR` (serve, generate, run, bench) runs a Hugging Face checkpoint directory
(engine/models/hf/) with its own tokenizer instead of a `--preset`; exactly one of the two.
`generate --model DIR "PROMPT" --json` takes PROMPT as raw text (tokenized as the
tokenizer does by default; `--chat` renders it through the chat template as one user
message), decodes greedily by default and prints `text`, `token_ids` (the generated ids),
`prompt_tokens` and timings.

`--store [SOCKET]` keeps segment signatures in a kvstore daemon (engine.connector) instead
of the engine's process: given without a value it uses the daemon's default socket
(KVSTORE_SOCKET, the kvstore config file, the per-user path). `main` rewrites a bare
`--store` into `--store=` before typer parses the command line (typer options cannot
have an optional value). With `--store`, `--share-cold` (the default) offers a request's
cold segments to idle engines attached to the same daemon and, while this engine is
idle (`serve`), computes segments other engines offer (engine.connector.coldshare);
`--no-share-cold` turns both off. The daemon must answer when the command starts (else
exit 3, naming the socket and how to start one), unless `--start-without-store`: then the
engine computes every prompt in full until the daemon answers. `serve` without `--store`
says on stderr that it caches nothing.

`--miss-signatures context` (PicConfig.miss_signatures) takes the signature of a miss
computed in context from the request's own pass instead of an idle alone pass; it needs
`--miss-path context` (serve's default; `run`'s default is alone, and `run --miss-signatures
context` without `--miss-path context` exits 2 naming both options rather than changing
the miss path behind the user's back).

`run` checks every request of the file (JSON, fields, a non-empty prompt that fits the
model) before it computes anything; in table mode it prints each request's row as it
finishes, a progress line on a terminal, and a summary whose mean TTFT leaves out the
first request (it carries the warm-up; reported apart).

These command and option names are an interface that scripts depend on; keep them.
Bad input exits with status 2 and a one-line message "kvengine: error: ..." naming the
option (or the file's line and request id); no daemon at --store: 3; a failure while
running: 1.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any, Optional

import typer

from engine.errors import ConfigError, EngineError, InvalidRequestError
from kvstore.cli_help import PlainHelpCommand

app = typer.Typer(
    name="kvengine",
    help="Hybrid-attention inference engine: serve, generate, list presets, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help (kvstore.cli_help): nothing cut at 80 columns
    context_settings={"max_content_width": 120},
)
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3  # as kvstore's commands

PresetOpt = typer.Option(None, "--preset", help="Preset name (see `kvengine presets`) or a saved model directory.")
ModelOpt = typer.Option(None, "--model", help="A Hugging Face model directory (config.json, *.safetensors, "
                        "tokenizer.json, ...), run with its own tokenizer; instead of --preset.")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
DtypeOpt = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16.")
MaxBatchOpt = typer.Option(32, "--max-batch", help="Requests holding caches at once (decode batch limit).")
BudgetOpt = typer.Option(2048, "--max-batched-tokens", help="Token budget of one scheduler step.")
ChunkOpt = typer.Option(512, "--chunk-size", help="Most prompt tokens one request computes per step.")
KvTokensOpt = typer.Option(None, "--kv-cache-tokens", help="Full-attention positions over all requests (default: sized from memory).")
MaxLenOpt = typer.Option(None, "--max-model-len", help="Longest prompt + output (default: the model's limit).")
GraphsOpt = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                         help="Replay decode steps as CUDA graphs (batch buckets up to 32; CUDA only).")
HostThreadsOpt = typer.Option(None, "--host-threads", min=1,
                              help="Threads of torch's CPU ops (default: 1 on CUDA, torch's default on the CPU).")
StoreOpt = typer.Option(
    None, "--store", metavar="[SOCKET]",
    help="Keep segment signatures in the kvstore daemon at SOCKET (bare --store: the default socket); "
         "without it the engine keeps them in its own process.")
StartWithoutStoreOpt = typer.Option(
    False, "--start-without-store",
    help="With --store: start even when no daemon answers at the socket (prompts are computed in full until it "
         "does); without this, a daemon that does not answer at start-up is an error (exit 3).")
ColdPolicyOpt = typer.Option(
    "fraction", "--cold-full-policy",
    help="When the cold fallback takes a request: fraction (at --cold-full-fraction) or cost (at the measured "
         "break-even share of misses, full / alone cost per token, at most --cold-full-fraction).")

def _miss_path_opt(default: str) -> Any:
    return typer.Option(
        default, "--miss-path",
        help="Where a request's uncached segments are computed: alone (one packed alone pass in the request, then "
             "spliced) or context (inside the request's fused pass, like prefix caching computes its misses; "
             "computed alone later while the engine is idle).")


def _miss_signatures_opt() -> Any:
    return typer.Option(
        "alone", "--miss-signatures",
        help="With --miss-path context, where the signatures of misses computed in context come from: alone (an "
             "alone pass per miss while the engine is idle) or context (taken from the request's own pass, kept "
             "once its first token is out; no idle alone pass).")


def _check_miss_signatures(miss_signatures: str, miss_path: str) -> None:
    """--miss-signatures context needs --miss-path context: say so in option names (PicConfig
    would refuse it too, in field names)."""
    if miss_signatures == "context" and miss_path == "alone":
        _fail("--miss-signatures: context takes a miss's signature from the request's own pass, where only "
              "--miss-path context computes it; add --miss-path context (got --miss-path alone)")


def _cold_opt(default: float) -> Any:
    return typer.Option(
        default, "--cold-full-fraction", min=0.0, max=1.0,
        help="pic/naive: a request whose uncached segments hold at least this share of its prompt is prefilled "
             "by full recompute, its segments computed alone later while the engine is idle (0: always compute "
             "them alone in the request).")


ShareColdOpt = typer.Option(
    True, "--share-cold/--no-share-cold",
    help="With --store: offer a request's cold segments to idle engines on the same daemon, and compute "
         "theirs while idle.")

ExactPrefixOpt = typer.Option(
    True, "--exact-prefix/--no-exact-prefix",
    help="pic: a request whose leading cached segments match an earlier sequence exactly restores the exact "
         "state there (no seam) and computes only the rest; exact states come from cold-fallback passes and idle "
         "time (with --store, also from the daemon).")

# ---- HiSparse offload (engine/hisparse/, docs/hisparse.md): one block of options, one settings object
HiSparseOpt = typer.Option(False, "--hisparse/--no-hisparse",
                           help="Offload full-attention KV in blocks (HiSparse): summaries and a hot buffer on the "
                                "device, top-k blocks per decode step read back from the block store.")
HiSparseBlockOpt = typer.Option(64, "--hisparse-block", min=1, help="HiSparse block size in tokens.")
HiSparseTopkOpt = typer.Option(32, "--hisparse-topk", min=1, help="HiSparse: blocks selected per step and layer "
                               "besides the sink and recent blocks.")
HiSparseHotOpt = typer.Option(64, "--hisparse-hot", min=2, help="HiSparse: hot-buffer blocks per sequence and layer "
                              "on the device (sink and recent blocks included).")
HiSparseMinOpt = typer.Option(4096, "--hisparse-min-context", min=0,
                              help="HiSparse selects blocks from this context length on (below: every block).")
HiSparseStoreOpt = typer.Option(None, "--hisparse-store", metavar="SOCKET",
                                help="HiSparse blocks go to the kvstore daemon at SOCKET ('default': the default "
                                     "socket); without it they stay in this process's memory.")


def _hisparse(on: bool, block: int, topk: int, hot: int, min_context: int, store: Optional[str]) -> Any:
    """The HiSparse settings of the `--hisparse*` options (None when off)."""
    if not on:
        return None
    from engine.hisparse.config import HiSparseConfig, HiSparseSettings
    from engine.hisparse.errors import HiSparseConfigError

    try:
        cfg = HiSparseConfig(enabled=True, block_size=block, topk=topk, hot_blocks=hot, min_context=min_context)
    except HiSparseConfigError as exc:
        _fail(f"--hisparse-hot: {exc}")
    return HiSparseSettings(cfg, None if store is None else ("" if store == "default" else store))


def _hisparse_report(engine) -> Optional[dict]:
    return None if engine.kv_offload is None else engine.kv_offload.snapshot()


# EngineConfig / LoadSpec field -> the option that sets it (for error messages)
OPTION_OF = {
    "max_num_seqs": "--max-batch",
    "max_num_batched_tokens": "--max-batched-tokens",
    "prefill_chunk_size": "--chunk-size",
    "max_tokens": "--max-new-tokens",
}


def _option(field: str) -> str:
    return OPTION_OF.get(field, "--" + field.replace("_", "-"))


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    typer.echo(f"kvengine: error: {message}", err=True)
    raise typer.Exit(code)


def _fail_field(exc: Exception) -> None:
    """A config error "name=value must be ..." as "--name: value must be ..."."""
    text = str(exc)
    name, sep, rest = text.partition("=")
    if sep and name.isidentifier():
        _fail(f"--{name.replace('_', '-')}: {rest}")
    _fail(text)


def _message(exc: Exception) -> str:
    """An exception's message without the quotes str() puts around a KeyError's."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def _note(message: str) -> None:
    """A line on stderr about a choice the user may not know was made."""
    typer.echo(f"kvengine: {message}", err=True)


def _engine_config(device: str, dtype: str, max_batch: int, max_batched_tokens: int, chunk_size: int,
                   kv_cache_tokens: Optional[int], max_model_len: Optional[int], cuda_graphs: bool = True,
                   host_threads: Optional[int] = None, hisparse: Any = None):
    from engine.builder import EngineConfig

    extra = {} if hisparse is None else {"hisparse": hisparse.config, "hisparse_store": hisparse.store}
    return EngineConfig(
        device=device, dtype=dtype, max_num_seqs=max_batch, max_num_batched_tokens=max_batched_tokens,
        prefill_chunk_size=chunk_size, kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
        cuda_graphs=cuda_graphs, host_threads=host_threads, **extra,
    )


def _model_source(preset: Optional[str], model: Optional[str]) -> str:
    """The model a command runs: `--preset NAME` or `--model DIR` (exactly one of them)."""
    if (preset is None) == (model is None):
        _fail("--preset/--model: give exactly one of --preset NAME or --model DIR")
    if preset is not None:
        return preset
    from pathlib import Path

    from engine.models.hf import is_hf_checkpoint

    if not Path(model).is_dir():
        _fail(f"--model: {model} is not a directory")
    if not is_hf_checkpoint(model):
        _fail(f"--model: {model} has no Hugging Face config.json (with a model_type)")
    return model


def _build(preset: str, cfg):
    from engine.builder import build_engine

    try:
        return build_engine(preset, cfg)
    except InvalidRequestError as exc:
        _fail(f"{_option(exc.field)}: {exc.message}")
    except EngineError as exc:
        _fail(_message(exc))


@app.command(cls=PlainHelpCommand)
def presets(as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table.")) -> None:
    """List the model presets: name, family, scale (tiny or bench) and layer pattern."""
    from engine.models.presets import list_presets, preset_info

    rows = [preset_info(cfg) for cfg in list_presets(real_shape=True)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "family", "scale", "parameters", "layers")
    for r in rows:
        params = r.get("parameters")
        table.add_row(r["name"], r["family"], r["scale"] + (" (real shape)" if r.get("real_shape") else ""), "" if params is None else f"{params / 1e6:,.1f}M",
                      _layer_pattern(r["layers"]))
    Console(width=None if sys.stdout.isatty() else 240).print(table)  # piped: not cut at 80 columns


def _runs(layers: list[str]) -> str:
    out: list[list] = []
    for kind in layers:
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in out)


def _layer_pattern(layers: list[str]) -> str:
    """Compact form of a layer list: "(gdn x3, full) x6", or runs when not periodic."""
    n = len(layers)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and layers == layers[:period] * (n // period):
            return f"({_runs(layers[:period])}) x{n // period}"
    return _runs(layers)


@app.command(cls=PlainHelpCommand)
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    preset: Optional[str] = PresetOpt,
    model: Optional[str] = ModelOpt,
    chat: bool = typer.Option(False, "--chat", help="--model: render PROMPT as one user message through the "
                              "checkpoint's chat template (default: PROMPT is raw text)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    hisparse: bool = HiSparseOpt,
    hisparse_block: int = HiSparseBlockOpt,
    hisparse_topk: int = HiSparseTopkOpt,
    hisparse_hot: int = HiSparseHotOpt,
    hisparse_min_context: int = HiSparseMinOpt,
    hisparse_store: Optional[str] = HiSparseStoreOpt,
) -> None:
    """Generate from one prompt; print the text and its timings."""
    from engine.runtime.sampling import SamplingParams

    source = _model_source(preset, model)
    if not prompt:
        _fail("PROMPT: must not be empty")
    if chat and model is None:
        _fail("--chat: needs --model (presets have no chat template)")
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    except ConfigError as exc:
        _fail_field(exc)
    hs = _hisparse(hisparse, hisparse_block, hisparse_topk, hisparse_hot, hisparse_min_context, hisparse_store)
    engine = _build(source, _engine_config(device, dtype, 1, 2048, 2048, None, None, hisparse=hs))
    if chat:
        try:
            prompt = engine.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
        except EngineError as exc:
            _fail(f"--chat: {exc}")
    try:
        (out,) = engine.generate([prompt], params)
    except InvalidRequestError as exc:
        _fail(f"{_option(exc.field)}: {exc.message}")
    except EngineError as exc:
        _fail(str(exc))
    finally:
        if engine.kv_offload is not None:
            engine.kv_offload.close()
    tl = out.timeline
    timings = {
        "prompt_tokens": out.num_prompt_tokens,
        "output_tokens": len(out.token_ids),
        "ttft_ms": round(tl.ttft * 1e3, 3),
        "decode_tokens_per_s": None if tl.decode_tokens_per_s is None else round(tl.decode_tokens_per_s, 2),
        "total_ms": round(tl.e2e * 1e3, 3),
        "finish_reason": out.finish_reason,
    }
    if engine.kv_offload is not None:
        timings["hisparse"] = _hisparse_report(engine)
    if as_json:
        typer.echo(json.dumps({"text": out.text, "token_ids": list(out.token_ids), **timings}))
        return
    typer.echo(out.text)
    dtps = "n/a" if timings["decode_tokens_per_s"] is None else f"{timings['decode_tokens_per_s']:.1f}"
    typer.echo(
        f"[prompt tokens: {timings['prompt_tokens']} | output tokens: {timings['output_tokens']} | "
        f"TTFT: {timings['ttft_ms']:.1f} ms | decode: {dtps} tokens/s | finish: {out.finish_reason}]",
        err=True,
    )


@app.command(cls=PlainHelpCommand)
def serve(
    preset: Optional[str] = PresetOpt,
    model: Optional[str] = ModelOpt,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0 picks a free port (printed)."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    max_batch: int = MaxBatchOpt,
    max_batched_tokens: int = BudgetOpt,
    chunk_size: int = ChunkOpt,
    kv_cache_tokens: Optional[int] = KvTokensOpt,
    max_model_len: Optional[int] = MaxLenOpt,
    log_level: str = typer.Option("info", "--log-level"),
    store: Optional[str] = StoreOpt,
    share_cold: bool = ShareColdOpt,
    start_without_store: bool = StartWithoutStoreOpt,
    cuda_graphs: bool = GraphsOpt,
    host_threads: Optional[int] = HostThreadsOpt,
    cold_full_fraction: float = _cold_opt(0.5),
    cold_full_policy: str = ColdPolicyOpt,
    miss_path: str = _miss_path_opt("context"),  # serving default: misses computed in the request, alone when idle (docs/pic.md)
    miss_signatures: str = _miss_signatures_opt(),
    exact_prefix: bool = ExactPrefixOpt,
    hisparse: bool = HiSparseOpt,
    hisparse_block: int = HiSparseBlockOpt,
    hisparse_topk: int = HiSparseTopkOpt,
    hisparse_hot: int = HiSparseHotOpt,
    hisparse_min_context: int = HiSparseMinOpt,
    hisparse_store: Optional[str] = HiSparseStoreOpt,
    kernel_cache: Optional[str] = typer.Option(
        None, "--kernel-cache", help="Directory of compiled GPU kernels and autotuning results, kept between runs "
        "(default: $TRITON_CACHE_DIR, else ~/.cache/hypercache/triton); a warm one skips kernel compilation at start."),
    prefill_graphs: str = typer.Option(
        "idle", "--prefill-graphs", help="When the prefill-stage CUDA graphs are captured: upfront (before the "
        "server answers), idle (after it answers, one bucket at a time while no request runs), lazy (by the first "
        "request of each bucket)."),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name", help="The model's name in /v1/models and the `model` field requests must "
        "match (default: the preset's name or the --model directory's name)."),
) -> None:
    """Serve the OpenAI-style HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics). With
    --store, prompts' cached segments are reused by position-independent caching through
    the kvstore daemon (shared with every engine attached to it)."""
    source = _model_source(preset, model)
    if served_model_name is not None and not served_model_name.strip():
        _fail("--served-model-name: must not be empty")
    _use_kernel_cache(kernel_cache)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.server.app import serve as run_server

    from engine.pic.config import PicConfig
    from engine.pic.errors import PicConfigError

    _check_miss_signatures(miss_signatures, miss_path)
    from engine.runtime.prefill_graphs import PREFILL_GRAPH_MODES

    if prefill_graphs not in PREFILL_GRAPH_MODES:
        _fail(f"--prefill-graphs: {prefill_graphs!r} is not one of {', '.join(PREFILL_GRAPH_MODES)}")
    try:  # before the (slow) engine build
        pic = PicConfig(cold_full_fraction=cold_full_fraction or None, cold_full_policy=cold_full_policy,
                        miss_path=miss_path, miss_signatures=miss_signatures, exact_prefix=exact_prefix)
    except PicConfigError as exc:
        _fail_field(exc)
    connector = _store_config(store, share_cold)
    hs = _hisparse(hisparse, hisparse_block, hisparse_topk, hisparse_hot, hisparse_min_context, hisparse_store)
    if hs is not None and connector is not None:
        _fail("--hisparse: HiSparse runs with the engine's own prefill; --store attaches position-independent "
              "caching, which fills the paged cache directly (use --hisparse-store for the blocks' daemon)")
    if connector is None:
        _note("no --store: every prompt is computed in full and nothing is cached; pass --store [SOCKET] to reuse "
              "prompt segments through a kvstore daemon")
    else:
        _check_store_answers(connector, start_without_store)
    config = _engine_config(device, dtype, max_batch, max_batched_tokens, chunk_size, kv_cache_tokens,
                            max_model_len, cuda_graphs, host_threads, hs)
    engine = _build(source, dataclasses.replace(config, prefill_graphs=prefill_graphs))
    _note_cache_size(kv_cache_tokens, max_batch)
    planner = _attach_store(engine, pic, connector) if connector is not None else None
    try:
        run_server(engine, host, port, served_model_name)
    except OSError as exc:
        _fail(f"--host/--port: cannot listen on {host}:{port} ({exc})", 1)
    finally:
        if planner is not None:
            planner.store.close()
        if engine.kv_offload is not None:
            engine.kv_offload.close()


def _use_kernel_cache(option: Optional[str]) -> None:
    """Point Triton's kernel and autotuning caches at the --kernel-cache directory (before
    any kernel module is imported: engine/kernel_cache.py). A default directory that cannot
    be made is a warning (Triton's own default is used), a named one an error."""
    from engine.kernel_cache import kernel_cache_dir, use_kernel_cache

    try:
        use_kernel_cache(kernel_cache_dir(option))
    except ConfigError as exc:
        if option is not None:
            _fail(f"--kernel-cache: {exc}")
        logging.getLogger(__name__).warning("kernel cache: %s; Triton's own default is used", exc)


def _check_store_answers(connector, start_without_store: bool) -> None:
    """--store names a daemon that must answer at start-up (exit 3 otherwise), unless
    --start-without-store: then the engine serves by recomputation until it appears."""
    from kvstore.client import KVStoreClient
    from kvstore.errors import KVStoreError

    try:
        with KVStoreClient(socket=connector.socket, tcp=connector.tcp, timeout=connector.rpc_timeout_s):
            return
    except KVStoreError as exc:
        if start_without_store:
            _note(f"--store: {exc}; starting without it (--start-without-store): prompts are computed in full "
                  "until the daemon answers")
            return
        _fail(f"--store: {exc} (or pass --start-without-store to serve by recomputation until it answers)",
              EXIT_NO_DAEMON)


def _note_cache_size(kv_cache_tokens: Optional[int], max_batch: int, block_size: Optional[int] = None) -> None:
    """Say so when --kv-cache-tokens was rounded: the cache holds whole blocks, plus one
    partial block per request slot."""
    if kv_cache_tokens is None:
        return
    from engine.builder import EngineConfig
    from engine.cache.manager import CacheConfig

    block = block_size or EngineConfig().block_size
    cfg = CacheConfig.for_tokens(kv_cache_tokens, num_slots=max_batch, block_size=block)
    positions = cfg.num_blocks * block
    if positions != kv_cache_tokens:
        _note(f"--kv-cache-tokens {kv_cache_tokens}: the cache holds {positions} positions ({cfg.num_blocks} "
              f"blocks of {block}: {kv_cache_tokens} rounded up to whole blocks, plus one partial block for each of "
              f"--max-batch {max_batch} requests)")


def _store_config(value: Optional[str], share_cold: bool = True):
    from engine.connector.attach import store_config
    from engine.connector.errors import ConnectorConfigError

    try:
        return store_config(value, share_cold=share_cold)
    except ConnectorConfigError as exc:
        _fail(f"--store: {exc}")


def _attach_store(engine, pic_config, connector):
    """Install PIC over the kvstore daemon (pic_config None: the default PIC options)."""
    from engine.connector.attach import attach_store
    from engine.connector.errors import ConnectorConfigError
    from engine.pic.config import PicConfig

    try:
        return attach_store(engine, pic_config or PicConfig(), connector)
    except ConnectorConfigError as exc:
        _fail(f"--store: {exc}")


@app.command(cls=PlainHelpCommand)
def bench(
    preset: Optional[str] = PresetOpt,
    model: Optional[str] = ModelOpt,
    num_requests: int = typer.Option(16, "--num-requests", min=1),
    prompt_len: int = typer.Option(256, "--prompt-len", min=1),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Poisson arrivals per second (default: all at once)."),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    max_batch: int = MaxBatchOpt,
    max_batched_tokens: int = BudgetOpt,
    chunk_size: int = ChunkOpt,
    kv_cache_tokens: Optional[int] = KvTokensOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    cuda_graphs: bool = GraphsOpt,
    host_threads: Optional[int] = HostThreadsOpt,
    hisparse: bool = HiSparseOpt,
    hisparse_block: int = HiSparseBlockOpt,
    hisparse_topk: int = HiSparseTopkOpt,
    hisparse_hot: int = HiSparseHotOpt,
    hisparse_min_context: int = HiSparseMinOpt,
    hisparse_store: Optional[str] = HiSparseStoreOpt,
) -> None:
    """Synthetic load: N requests of a given prompt length; TTFT p50/p99 and throughput."""
    from engine.bench import LoadSpec, run_load

    source = _model_source(preset, model)
    spec = LoadSpec(num_requests=num_requests, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                    request_rate=request_rate, seed=seed)
    try:
        spec.validate()
    except InvalidRequestError as exc:
        _fail(f"{_option(exc.field)}: {exc.message}")
    hs = _hisparse(hisparse, hisparse_block, hisparse_topk, hisparse_hot, hisparse_min_context, hisparse_store)
    engine = _build(source, _engine_config(device, dtype, max_batch, max_batched_tokens, chunk_size,
                                           kv_cache_tokens, None, cuda_graphs, host_threads, hs))
    _note_cache_size(kv_cache_tokens, max_batch)
    try:
        report = run_load(engine, spec)
    except EngineError as exc:
        _fail(str(exc), 1)
    finally:
        if engine.kv_offload is not None:
            engine.kv_offload.close()
    result = {"preset": source, "device": str(engine.device), **spec.__dict__, **report.as_dict()}
    if engine.kv_offload is not None:
        result["hisparse"] = _hisparse_report(engine)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"{source}: {report.num_requests} requests x {prompt_len} prompt tokens -> {max_new_tokens} new tokens "
        f"in {report.duration_s:.2f} s on {engine.device}\n"
        f"  TTFT ms   p50 {report.ttft_ms_p50:.1f}  p99 {report.ttft_ms_p99:.1f}  mean {report.ttft_ms_mean:.1f}\n"
        f"  TPOT ms   p50 {report.tpot_ms_p50:.2f}   e2e ms p50 {report.e2e_ms_p50:.1f}  p99 {report.e2e_ms_p99:.1f}\n"
        f"  throughput {report.requests_per_s:.2f} req/s, {report.output_tokens_per_s:.1f} output tok/s, "
        f"{report.total_tokens_per_s:.1f} total tok/s, {report.num_preemptions} preemptions"
    )


@app.command("run", cls=PlainHelpCommand)
def run_cmd(
    preset: Optional[str] = PresetOpt,
    model: Optional[str] = ModelOpt,
    requests: str = typer.Option(..., "--requests", help="JSONL file, one {id, segments: [{text, cache}]} per line."),
    method: str = typer.Option("pic", "--method", help="full, prefix, naive or pic."),
    seam: int = typer.Option(16, "--seam", min=0, help="pic: tokens recomputed in context at the head of each spliced segment after the first."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=0),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per request instead of a table."),
    swa_seam: str = typer.Option("window", "--swa-seam", help="SWA seam policy: window (max(seam, window)) or seam."),
    fused: bool = typer.Option(True, "--fused/--no-fused", help="pic/naive: seams, splices and suffix in one pass through the layers (default) or one pass per computed range."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    state_dtype: str = typer.Option("auto", "--state-dtype", help="dtype of cached linear states and delta-rule T (auto: the model's when it runs in bf16/fp16, else float32; float32, bfloat16, float16)."),
    cache_gib: float = typer.Option(2.0, "--cache-gib", min=0.0, help="Capacity of the in-process signature cache / prefix tree."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    chunk_size: int = ChunkOpt,
    store: Optional[str] = StoreOpt,
    share_cold: bool = ShareColdOpt,
    start_without_store: bool = StartWithoutStoreOpt,
    cold_full_fraction: float = _cold_opt(0.0),
    cold_full_policy: str = ColdPolicyOpt,
    miss_path: str = _miss_path_opt("alone"),
    miss_signatures: str = _miss_signatures_opt(),
    prefix_checkpoints: str = typer.Option("branch", "--prefix-checkpoints", help="prefix: where linear states are kept: branch (the end of each request's cacheable prefix and where it leaves a cached path) or every (every cacheable segment boundary)."),
    exact_prefix: bool = ExactPrefixOpt,
    hisparse: bool = HiSparseOpt,
    hisparse_block: int = HiSparseBlockOpt,
    hisparse_topk: int = HiSparseTopkOpt,
    hisparse_hot: int = HiSparseHotOpt,
    hisparse_min_context: int = HiSparseMinOpt,
    hisparse_store: Optional[str] = HiSparseStoreOpt,
) -> None:
    """Run segmented requests in file order with one prefill method (position-independent
    caching or a baseline); print reuse and timing per request. With --store, signatures
    come from and go to the kvstore daemon, so a later run (another process) reuses what
    an earlier one computed."""
    from engine.pic.config import PicConfig
    from engine.pic.errors import PicConfigError
    from engine.pic.run import attach_planner, read_requests

    source = _model_source(preset, model)
    _check_miss_signatures(miss_signatures, miss_path)
    if _hisparse(hisparse, hisparse_block, hisparse_topk, hisparse_hot, hisparse_min_context,
                 hisparse_store) is not None:
        _fail("--hisparse: run's prefill methods (full, prefix, naive, pic) fill the paged KV cache directly; "
              "HiSparse offload runs with generate, bench and serve")
    try:
        cap = int(cache_gib * (1 << 30))
        config = PicConfig(method=method, seam=seam, swa_seam=swa_seam, state_dtype=state_dtype,
                           signature_cache_bytes=cap, prefix_cache_bytes=cap, fused=fused,
                           cold_full_fraction=cold_full_fraction or None, cold_full_policy=cold_full_policy,
                           miss_path=miss_path, miss_signatures=miss_signatures,
                           prefix_checkpoints=prefix_checkpoints, exact_prefix=exact_prefix)
    except PicConfigError as exc:
        _fail_field(exc)
    try:
        reqs = read_requests(requests)
    except InvalidRequestError as exc:
        _fail(f"--requests: {exc.message}" if exc.field == "requests" else f"--requests: {exc}")
    connector = _store_config(store, share_cold)
    if connector is not None and method not in ("pic", "naive", "prefix"):
        _fail(f"--store: method {method!r} keeps nothing in the store; use --method pic, naive or prefix")
    if connector is not None:
        _check_store_answers(connector, start_without_store)
    engine = _build(source, _engine_config(device, dtype, 1, max(2048, chunk_size), chunk_size, None, None))
    _check_requests(engine, reqs, max_new_tokens, stop)  # every request, before any runs
    planner = attach_planner(engine, config) if connector is None else _attach_store(engine, config, connector)
    try:
        _run_and_print(engine, planner, reqs, max_new_tokens, stop, as_json, source, method, connector is not None,
                       fused)
    finally:
        if connector is not None:
            planner.store.close()  # finishes the queued puts: the next process finds them


def _check_requests(engine, reqs, max_new_tokens: int, stop: Optional[list[str]]) -> None:
    """Refuse the run (exit 2) at the first request the engine would refuse, naming its
    line and id, before computing anything."""
    from engine.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_strings=tuple(stop or ()))
    for r in reqs:
        try:
            engine.check_prompt(r.segments, params)
        except InvalidRequestError as exc:
            field = _option(exc.field) if exc.field == "max_new_tokens" else exc.field
            _fail(f"--requests: {r.where} (id {r.id}): {field}: {exc.message}")


def _run_and_print(engine, planner, reqs, max_new_tokens, stop, as_json, preset, method, with_store,
                   fused: bool = True) -> None:
    from engine.pic.run import RunTable, run_requests

    table = None
    if not as_json:
        title = f"{preset} method={method}" + (f" seam={planner.seam}" if hasattr(planner, "seam") else "")
        table = RunTable(title, fused=fused and method in ("pic", "naive", "prefix"))
    progress = _Progress(len(reqs)) if sys.stderr.isatty() else None
    try:
        for i, rec in enumerate(run_requests(engine, planner, reqs, max_new_tokens, tuple(stop or ()),
                                             idle_between=True)):
            if with_store:
                sr = planner.take_store_report(rec["id"])
                if sr is not None:
                    rec.update(sr.as_dict())
            if progress is not None:
                progress.done(i + 1, rec["id"])
            if as_json:
                typer.echo(json.dumps(rec))
            else:
                table.add(rec)
    except InvalidRequestError as exc:
        _fail(f"{exc.field}: {exc.message}", 1)
    except EngineError as exc:
        _fail(str(exc), 1)
    finally:
        if progress is not None:
            progress.close()
    while engine.help_idle():  # cold fallback, context signatures, exact prefixes: finish the queued work
        pass
    if with_store:
        planner.store.flush()
    if table is not None:
        stats = planner.cache.stats().as_dict() if hasattr(planner, "cache") else (
            planner.tree.stats() if hasattr(planner, "tree") else None)
        table.finish(stats)
        if with_store:
            typer.echo(f"store connector: {json.dumps(planner.store.metrics.snapshot())}")


class _Progress:
    """`[i/N] done: ID` on one rewritten stderr line while requests run (a terminal only)."""

    def __init__(self, total: int) -> None:
        self.total = total
        sys.stderr.write(f"\r[0/{total}] running...")
        sys.stderr.flush()

    def done(self, i: int, request_id: str) -> None:
        sys.stderr.write(f"\r\033[K[{i}/{self.total}] done: {request_id}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def expand_bare_store(argv: list[str]) -> list[str]:
    """`--store` given without a value (last, or followed by another option) becomes
    `--store=` (the default socket); everything else is left as it is."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--store" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("--store=")
        else:
            out.append(arg)
    return out


def main() -> None:
    app(args=expand_bare_store(sys.argv[1:]), prog_name="kvengine")


if __name__ == "__main__":
    sys.exit(main())
