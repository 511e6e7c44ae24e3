"""`kvengine serve`: the OpenAI-style HTTP API (engine.server) over one engine.

With `--store [SOCKET]` prompts' cached segments are reused by position-independent
caching through the kvstore daemon (engine.connector), with the PIC and connector
settings of engine.connector.settings.PicSettings (defaults, `--pic-config FILE`,
`--seam`). Without `--store` every prompt is computed in full and nothing is cached (it
says so on stderr); PIC options given without `--store` (`--pic-config`, `--seam`) are
refused (exit 2) rather than ignored.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import typer

from engine.cli_options import (BudgetOpt, GraphsOpt, HostThreadsOpt, KvTokensOpt, MaxBatchOpt, MaxLenOpt, PicArgs,
                                attach_store, build, check_store_answers, connector_config, engine_config, fail,
                                hisparse_settings, model_source, note, note_cache_size, pic_for_hisparse, pic_options,
                                pic_settings)


@pic_options
def serve(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0 picks a free port (printed)."),
    max_batch: int = MaxBatchOpt,
    max_batched_tokens: int = BudgetOpt,
    kv_cache_tokens: Optional[int] = KvTokensOpt,
    max_model_len: Optional[int] = MaxLenOpt,
    log_level: str = typer.Option("info", "--log-level"),
    cuda_graphs: bool = GraphsOpt,
    host_threads: Optional[int] = HostThreadsOpt,
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
    *,
    opts: PicArgs,
) -> None:
    """Serve the OpenAI-style HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics). With --store, prompts' cached segments are reused by
    position-independent caching through the kvstore daemon (shared with every engine
    attached to it)."""
    source = model_source(opts.preset, opts.model)
    if served_model_name is not None and not served_model_name.strip():
        fail("--served-model-name: must not be empty")
    _use_kernel_cache(kernel_cache)
    from engine.runtime.prefill_graphs import PREFILL_GRAPH_MODES

    if prefill_graphs not in PREFILL_GRAPH_MODES:
        fail(f"--prefill-graphs: {prefill_graphs!r} is not one of {', '.join(PREFILL_GRAPH_MODES)}")
    if opts.store is None:
        given = [name for name, value in (("--pic-config", opts.pic_config), ("--seam", opts.seam))
                 if value is not None]
        if given:
            fail(f"{given[0]}: serve runs position-independent caching only through a kvstore daemon; add --store "
                 "[SOCKET] (without it every prompt is computed in full)")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.server.app import serve as run_server

    settings = pic_settings(opts)  # before the (slow) engine build
    connector = connector_config(settings, opts.store)
    hs = hisparse_settings(opts.hisparse)
    if hs is not None and connector is not None:
        settings = dataclasses.replace(settings, pic=pic_for_hisparse(settings.pic))
    if connector is None:
        note("no --store: every prompt is computed in full and nothing is cached; pass --store [SOCKET] to reuse "
             "prompt segments through a kvstore daemon")
    else:
        check_store_answers(connector, opts.start_without_store)
    config = engine_config(opts.device, opts.dtype, max_batch, max_batched_tokens, opts.chunk_size, kv_cache_tokens,
                           max_model_len, cuda_graphs, host_threads, hs)
    engine = build(source, dataclasses.replace(config, prefill_graphs=prefill_graphs))
    note_cache_size(kv_cache_tokens, max_batch)
    planner = attach_store(engine, settings.pic, connector) if connector is not None else None
    try:
        run_server(engine, host, port, served_model_name)
    except OSError as exc:
        fail(f"--host/--port: cannot listen on {host}:{port} ({exc})", 1)
    finally:
        if planner is not None:
            planner.store.close()
        if engine.kv_offload is not None:
            engine.kv_offload.close()


def _use_kernel_cache(option: Optional[str]) -> None:
    """Point Triton's kernel and autotuning caches at the --kernel-cache directory (before
    any kernel module is imported: engine/kernel_cache.py). A default directory that cannot
    be made is a warning (Triton's own default is used), a named one an error."""
    from engine.errors import ConfigError
    from engine.kernel_cache import kernel_cache_dir, use_kernel_cache

    try:
        use_kernel_cache(kernel_cache_dir(option))
    except ConfigError as exc:
        if option is not None:
            fail(f"--kernel-cache: {exc}")
        logging.getLogger(__name__).warning("kernel cache: %s; Triton's own default is used", exc)
