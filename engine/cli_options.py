"""The options `kvengine`'s commands share and the helpers that turn them into engine and
PIC settings: typer option objects, the one option list of `run` and `serve`
(`pic_options`), error exits ("kvengine: error: ..." and exit 2), the engine build and
the kvstore daemon checks.

PIC and connector settings come from ONE object, engine.connector.settings.PicSettings:
its defaults, then a `--pic-config FILE` (TOML, docs/pic.md "Settings"), then the flags
the user gave (`--method`, `--seam`, `--store`), each level over the one before.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import typer

from engine.errors import EngineError, InvalidRequestError

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

# ---- HiSparse offload (engine/hisparse/, docs/hisparse.md): one block of options, one settings object
HiSparseOpt = typer.Option(False, "--hisparse/--no-hisparse",
                           help="Offload full-attention KV in blocks (HiSparse): summaries and a hot buffer on the "
                                "device, top-k blocks per decode step read back from the block store.")
HiSparseBlockOpt = typer.Option(64, "--hisparse-block", min=1, help="HiSparse block size in tokens.")
HiSparseTopkOpt = typer.Option(32, "--hisparse-topk", min=1, help="HiSparse: blocks selected per step and layer "
                               "besides the sink and recent blocks.")
HiSparseHotOpt = typer.Option(0, "--hisparse-hot", min=0, help="HiSparse: hot-buffer blocks per sequence and layer "
                              "on the device (sink and recent blocks included); 0: auto, the blocks one step "
                              "attends to (sink + recent + KV heads x top-k).")
HiSparseMinOpt = typer.Option(4096, "--hisparse-min-context", min=0,
                              help="HiSparse selects blocks from this context length on (below: every block).")
HiSparseStoreOpt = typer.Option(None, "--hisparse-store", metavar="SOCKET",
                                help="HiSparse blocks go to the kvstore daemon at SOCKET ('default': the default "
                                     "socket); without it they stay in this process's memory.")


@dataclass(frozen=True)
class HiSparseArgs:
    """The `--hisparse*` options as given."""

    on: bool = False
    block: int = 64
    topk: int = 32
    hot: int = 64
    min_context: int = 4096
    store: Optional[str] = None


@dataclass(frozen=True)
class PicArgs:
    """The options `run` and `serve` share (`pic_options`), as given (None: not given)."""

    preset: Optional[str]
    model: Optional[str]
    device: str
    dtype: str
    chunk_size: int
    store: Optional[str]
    start_without_store: bool
    seam: Optional[int]
    pic_config: Optional[str]
    hisparse: HiSparseArgs


def _param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


#: the one option list of `run` and `serve`, in help order
PIC_PARAMS = (
    _param("preset", Optional[str], PresetOpt),
    _param("model", Optional[str], ModelOpt),
    _param("device", str, DeviceOpt),
    _param("dtype", str, DtypeOpt),
    _param("chunk_size", int, ChunkOpt),
    _param("store", Optional[str], typer.Option(
        None, "--store", metavar="[SOCKET]",
        help="Keep segment signatures in the kvstore daemon at SOCKET (bare --store: the default socket).")),
    _param("start_without_store", bool, typer.Option(
        False, "--start-without-store",
        help="With --store: start even when no daemon answers at the socket (prompts are computed in full until it "
             "does); without this, a daemon that does not answer at start-up is an error (exit 3).")),
    _param("seam", Optional[int], typer.Option(
        None, "--seam", min=0, metavar="N",
        help="pic: tokens recomputed in context at the head of each spliced segment after the first "
             "(default 16).")),
    _param("pic_config", Optional[str], typer.Option(
        None, "--pic-config", metavar="FILE",
        help="PIC and store-connector settings, a TOML file with [pic] and [store] tables (docs/pic.md, "
             "docs/examples/pic.toml); flags given on the command line win over it.")),
    _param("hisparse", bool, HiSparseOpt),
    _param("hisparse_block", int, HiSparseBlockOpt),
    _param("hisparse_topk", int, HiSparseTopkOpt),
    _param("hisparse_hot", int, HiSparseHotOpt),
    _param("hisparse_min_context", int, HiSparseMinOpt),
    _param("hisparse_store", Optional[str], HiSparseStoreOpt),
)
_HISPARSE_FIELDS = {"hisparse": "on", "hisparse_block": "block", "hisparse_topk": "topk", "hisparse_hot": "hot",
                    "hisparse_min_context": "min_context", "hisparse_store": "store"}


def pic_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the shared option list (PIC_PARAMS) after its own parameters; the
    command receives them as one `opts: PicArgs` keyword argument."""
    sig = inspect.signature(func, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    shared = {p.name for p in PIC_PARAMS}

    @functools.wraps(func)
    def command(**kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in shared}
        hs = HiSparseArgs(**{_HISPARSE_FIELDS[k]: given.pop(k) for k in _HISPARSE_FIELDS})
        return func(opts=PicArgs(hisparse=hs, **given), **kwargs)

    params = own + list(PIC_PARAMS)
    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # typer reads the signature above, not func's
    return command


# EngineConfig / LoadSpec field -> the option that sets it (for error messages)
OPTION_OF = {
    "max_num_seqs": "--max-batch",
    "max_num_batched_tokens": "--max-batched-tokens",
    "prefill_chunk_size": "--chunk-size",
    "max_tokens": "--max-new-tokens",
}


def option(field: str) -> str:
    return OPTION_OF.get(field, "--" + field.replace("_", "-"))


def fail(message: str, code: int = EXIT_USAGE) -> None:
    typer.echo(f"kvengine: error: {message}", err=True)
    raise typer.Exit(code)


def fail_field(exc: Exception) -> None:
    """A config error "name=value must be ..." as "--name: value must be ..."."""
    text = str(exc)
    name, sep, rest = text.partition("=")
    if sep and name.isidentifier():
        fail(f"--{name.replace('_', '-')}: {rest}")
    fail(text)


def message(exc: Exception) -> str:
    """An exception's message without the quotes str() puts around a KeyError's."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def note(text: str) -> None:
    """A line on stderr about a choice the user may not know was made."""
    typer.echo(f"kvengine: {text}", err=True)


def pic_settings(opts: PicArgs, method: Optional[str] = None):
    """The PicSettings of a command: defaults, then --pic-config, then --method/--seam."""
    from engine.connector.settings import PicSettings, PicSettingsError, load_settings

    settings = PicSettings()
    if opts.pic_config is not None:
        try:
            settings = load_settings(opts.pic_config)
        except PicSettingsError as exc:
            fail(f"--pic-config: {exc}")
    try:
        return settings.with_pic(method=method, seam=opts.seam)
    except PicSettingsError as exc:
        fail_field(exc)


def connector_config(settings, store: Optional[str]):
    """The connector config of --store (None without it), with the [store] settings."""
    from engine.connector.settings import PicSettingsError

    try:
        return settings.connector(store)
    except PicSettingsError as exc:
        fail(f"--store: {exc}")


def hisparse_settings(hs: HiSparseArgs) -> Any:
    """The HiSparse settings of the `--hisparse*` options (None when off)."""
    if not hs.on:
        return None
    from engine.hisparse.config import HiSparseConfig, HiSparseSettings
    from engine.hisparse.errors import HiSparseConfigError

    try:
        cfg = HiSparseConfig(enabled=True, block_size=hs.block, topk=hs.topk, hot_blocks=hs.hot,
                             min_context=hs.min_context)
    except HiSparseConfigError as exc:
        fail(f"--hisparse-hot: {exc}")
    return HiSparseSettings(cfg, None if hs.store is None else ("" if hs.store == "default" else hs.store))


def pic_for_hisparse(config: Any) -> Any:
    """PIC's config under HiSparse: methods pic and naive only (their splices and fused
    passes write full-attention K/V through the HiSparse layer caches); exact prefixes off
    (their checkpoints restore into the paged KV cache), with a note when that changes it."""
    import dataclasses

    if config.method not in ("pic", "naive"):
        fail(f"--hisparse: method {config.method!r} fills the paged KV cache directly; HiSparse runs with "
             "--method pic or naive")
    if config.method == "pic" and config.exact_prefix:
        note("--hisparse: exact-prefix reuse is off (its checkpoints restore into the paged KV cache)")
        config = dataclasses.replace(config, exact_prefix=False)
    return config


def hisparse_report(engine) -> Optional[dict]:
    return None if engine.kv_offload is None else engine.kv_offload.snapshot()


def engine_config(device: str, dtype: str, max_batch: int, max_batched_tokens: int, chunk_size: int,
                  kv_cache_tokens: Optional[int], max_model_len: Optional[int], cuda_graphs: bool = True,
                  host_threads: Optional[int] = None, hisparse: Any = None):
    from engine.builder import EngineConfig

    extra = {} if hisparse is None else {"hisparse": hisparse.config, "hisparse_store": hisparse.store}
    return EngineConfig(
        device=device, dtype=dtype, max_num_seqs=max_batch, max_num_batched_tokens=max_batched_tokens,
        prefill_chunk_size=chunk_size, kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
        cuda_graphs=cuda_graphs, host_threads=host_threads, **extra,
    )


def model_source(preset: Optional[str], model: Optional[str]) -> str:
    """The model a command runs: `--preset NAME` or `--model DIR` (exactly one of them)."""
    if (preset is None) == (model is None):
        fail("--preset/--model: give exactly one of --preset NAME or --model DIR")
    if preset is not None:
        return preset
    from pathlib import Path

    from engine.models.hf import is_hf_checkpoint

    if not Path(model).is_dir():
        fail(f"--model: {model} is not a directory")
    if not is_hf_checkpoint(model):
        fail(f"--model: {model} has no Hugging Face config.json (with a model_type)")
    return model


def build(preset: str, cfg):
    from engine.builder import build_engine

    try:
        return build_engine(preset, cfg)
    except InvalidRequestError as exc:
        fail(f"{option(exc.field)}: {exc.message}")
    except EngineError as exc:
        fail(message(exc))


def check_store_answers(connector, start_without_store: bool) -> None:
    """--store names a daemon that must answer at start-up (exit 3 otherwise), unless
    --start-without-store: then the engine serves by recomputation until it appears."""
    from kvstore.client import KVStoreClient
    from kvstore.errors import KVStoreError

    try:
        with KVStoreClient(socket=connector.socket, tcp=connector.tcp, timeout=connector.rpc_timeout_s):
            return
    except KVStoreError as exc:
        if start_without_store:
            note(f"--store: {exc}; starting without it (--start-without-store): prompts are computed in full "
                 "until the daemon answers")
            return
        fail(f"--store: {exc} (or pass --start-without-store to serve by recomputation until it answers)",
             EXIT_NO_DAEMON)


def note_cache_size(kv_cache_tokens: Optional[int], max_batch: int, block_size: Optional[int] = None) -> None:
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
        note(f"--kv-cache-tokens {kv_cache_tokens}: the cache holds {positions} positions ({cfg.num_blocks} "
             f"blocks of {block}: {kv_cache_tokens} rounded up to whole blocks, plus one partial block for each of "
             f"--max-batch {max_batch} requests)")


def attach_store(engine, pic_config, connector):
    """Install PIC over the kvstore daemon."""
    from engine.connector.attach import attach_store as attach
    from engine.connector.errors import ConnectorConfigError

    try:
        return attach(engine, pic_config, connector)
    except ConnectorConfigError as exc:
        fail(f"--store: {exc}")
