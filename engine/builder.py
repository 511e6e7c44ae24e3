"""Building a ready `LLMEngine` from a preset name or a weights directory.

`EngineConfig` holds the serving knobs (device, dtype, batch and token budgets, cache
size); `build_engine` loads the model, sizes and creates its caches, and wires runner,
cache pool, scheduler and planner together. The CLI and the benchmarks build engines
only through here.

Cache sizing: `kv_cache_tokens` is the number of full-attention positions all live
requests may hold together (paged KV). Left unset, it is sized from memory: on CUDA,
`gpu_memory_utilization` of the free memory after the model loaded, less a reserve for
activations; on the CPU, `max_num_seqs * max_model_len` capped at `CPU_DEFAULT_KV_TOKENS`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from engine.cache.manager import CacheConfig, CacheManager, cache_specs
from engine.engine import LLMEngine, external_kv_planner
from engine.errors import InvalidRequestError
from engine.hisparse.config import HiSparseConfig
from engine.models.layers import fla_backend
from engine.runtime.cache_pool import ManagedCachePool
from engine.runtime.planner import PrefillPlanner
from engine.pic.kernel_warmup import RecurrenceKernelWarmup
from engine.runtime.prefill_graphs import PREFILL_GRAPH_MODES, DecodeGraphWarmup, PrefillGraphWarmup
from engine.runtime.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 1 << 16
ACTIVATION_RESERVE_BYTES = 4 << 30  # left free on the GPU for prefill activations
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. `device`/`dtype` "auto": CUDA and bfloat16 when a GPU is present,
    else CPU and float32."""

    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    block_size: int = 16
    kv_cache_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    #: replay decode steps as CUDA graphs (batch buckets 1..32) where the device is CUDA
    cuda_graphs: bool = True
    #: threads of torch's CPU ops in this process (torch.set_num_threads). None: 1 when
    #: the device is CUDA (the host side is small index work; a pool of one thread per
    #: core stalls for milliseconds whenever its threads contend with the put/load
    #: threads or other engines on the host: H200 serving traces, 2026-11-30, showed
    #: 5-13 ms per tiny CPU op that goes parallel), unchanged on the CPU
    host_threads: Optional[int] = None
    #: HiSparse offload of full-attention KV (engine/hisparse/, docs/hisparse.md); off by default
    hisparse: HiSparseConfig = HiSparseConfig()
    #: kvstore daemon socket for HiSparse blocks ("" the default socket); None: this
    #: process's memory
    hisparse_store: Optional[str] = None
    #: when the prefill-stage CUDA graphs are captured (engine.runtime.prefill_graphs):
    #: "upfront" before the engine is returned, "idle" by the server's engine loop while no
    #: request runs (`kvengine serve`'s default: ready without waiting for them), "lazy" on
    #: first use. Upfront here: an engine driven without the server loop has no idle time.
    #: The decode graph buckets (up to max_num_seqs) follow the same mode, after them
    prefill_graphs: str = "upfront"

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequestError("device", f"unknown device {name!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device", f"{name!r} asked for, but CUDA is not available here")
    return dev


def apply_host_threads(threads: Optional[int], device: torch.device) -> int:
    """Set torch's CPU thread count for an engine on `device` (EngineConfig.host_threads);
    returns the count in effect."""
    if threads is not None and threads < 1:
        raise InvalidRequestError("host_threads", f"{threads} must be >= 1")
    if threads is None and device.type == "cuda":
        threads = 1
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise InvalidRequestError("dtype", f"{name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _kv_cache_tokens(model: torch.nn.Module, cfg: EngineConfig, max_model_len: int, device: torch.device, dtype: torch.dtype) -> int:
    if cfg.kv_cache_tokens is not None:
        if cfg.kv_cache_tokens < 1:
            raise InvalidRequestError("kv_cache_tokens", f"must be >= 1, got {cfg.kv_cache_tokens}")
        return cfg.kv_cache_tokens
    if device.type != "cuda":
        return min(cfg.max_num_seqs * max_model_len, CPU_DEFAULT_KV_TOKENS)
    probe = CacheManager(cache_specs(model), CacheConfig(block_size=cfg.block_size, num_blocks=0, num_slots=1), device, dtype)
    per_block = probe.bytes_per_block()
    if per_block == 0:
        return cfg.max_num_seqs * max_model_len  # no full-attention layers: blocks cost nothing
    free, _total = torch.cuda.mem_get_info(device)
    budget = free * cfg.gpu_memory_utilization - ACTIVATION_RESERVE_BYTES - probe.bytes_per_slot() * cfg.max_num_seqs
    blocks = int(budget // per_block)
    if blocks < 1:
        raise InvalidRequestError("gpu_memory_utilization", f"leaves no memory for the KV cache ({free / 2**30:.1f} GiB free)")
    return min(blocks * cfg.block_size, cfg.max_num_seqs * max_model_len)


def model_tokenizer(preset_or_dir: str):
    """The tokenizer of a model source: a Hugging Face checkpoint's own (engine/models/hf/
    tokenizer.py), else the byte tokenizer of the presets and the models trained here."""
    from engine.models.hf import is_hf_checkpoint
    from engine.tokenizer import load_tokenizer

    if is_hf_checkpoint(preset_or_dir):
        from engine.models.hf.tokenizer import CheckpointTokenizer

        return CheckpointTokenizer(preset_or_dir)
    return load_tokenizer("byte")


def prefill_graph_warmup(runner, mode: str) -> PrefillGraphWarmup:
    """The runner's prefill-stage graphs in `mode` (EngineConfig.prefill_graphs): upfront
    ones are captured here, one placeholder pass per bucket on a scratch sequence."""
    from engine.pic.fused import capture_prefill_stages

    return PrefillGraphWarmup(runner.prefill_stages, lambda b: capture_prefill_stages(runner, buckets=(b,)), mode)


def build_engine(
    preset_or_dir: str,
    config: EngineConfig = EngineConfig(),
    planner: Optional[PrefillPlanner] = None,
) -> LLMEngine:
    """Load the model named by a preset (or a saved weights directory, or a Hugging Face
    checkpoint directory, with its own tokenizer) and return an idle engine serving it."""
    from engine.models.weights import load_model
    from engine.runtime.runner import ModelRunner

    if config.prefill_graphs not in PREFILL_GRAPH_MODES:
        raise InvalidRequestError("prefill_graphs", f"{config.prefill_graphs!r} is not one of "
                                  f"{', '.join(PREFILL_GRAPH_MODES)}")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    apply_host_threads(config.host_threads, device)
    # fla's import (seconds) overlaps the model load; joined before the runner picks its backend
    fla_import = fla_backend.import_in_background() if device.type == "cuda" else None
    t_load = time.perf_counter()
    loaded = load_model(preset_or_dir, device=device, dtype=dtype)
    model, mcfg = loaded.model, loaded.config
    log.info("loaded model %s (%s) on %s/%s in %.2f s", mcfg.name, loaded.source, device, dtype,
             time.perf_counter() - t_load)
    max_model_len = config.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings:
        raise InvalidRequestError(
            "max_model_len", f"{max_model_len} exceeds the model's max_position_embeddings {mcfg.max_position_embeddings}"
        )
    if fla_import is not None:
        t_join = time.perf_counter()
        fla_import.join()
        log.info("fla import joined after the load (waited %.2f s)", time.perf_counter() - t_join)
    offload = None
    if config.hisparse.enabled:
        if planner is not None and not external_kv_planner(planner):
            raise InvalidRequestError("hisparse", "HiSparse runs with the engine's own chunked prefill or PIC, not with "
                                      f"{type(planner).__name__}")
        offload = build_hisparse(config, max_model_len, device, dtype, loaded.fingerprint)
        cache_cfg = CacheConfig(block_size=config.block_size, num_blocks=0, num_slots=config.max_num_seqs)
        manager = CacheManager(cache_specs(model), cache_cfg, device, dtype, external_kv=offload.layer_cache)
        runner = ModelRunner(model, manager, cuda_graphs=None if config.cuda_graphs else False)
        hs = config.hisparse
        log.info("hisparse on: blocks of %d, top-%d, hot buffer %d, from %d tokens; %s; %.1f MiB per sequence on %s",
                 hs.block_size, hs.topk, offload.hot_blocks, hs.min_context, offload.store_name,
                 offload.device_bytes_per_slot() / 2**20, device)
    else:
        tokens = _kv_cache_tokens(model, config, max_model_len, device, dtype)
        cache_cfg = CacheConfig.for_tokens(tokens, num_slots=config.max_num_seqs, block_size=config.block_size)
        manager = CacheManager.for_model(model, cache_cfg)
        runner = ModelRunner(model, manager, cuda_graphs=None if config.cuda_graphs else False)
    # fla's chunk kernels for every pattern the engine launches, before any graph capture
    recurrence_kernels = RecurrenceKernelWarmup(model, runner.backend, device, dtype, config.prefill_graphs)
    prefill_graphs = prefill_graph_warmup(runner, config.prefill_graphs)
    # the decode graph buckets up to max_num_seqs, in the same mode (after the prefill stages)
    decode_graphs = DecodeGraphWarmup(runner, config.max_num_seqs, config.prefill_graphs)
    pool = ManagedCachePool(manager)
    log.info(
        "engine for %s on %s/%s: %d KV blocks of %d, %d slots",
        mcfg.name, device, dtype, cache_cfg.num_blocks, cache_cfg.block_size, cache_cfg.num_slots,
    )
    return LLMEngine(
        runner,
        model_tokenizer(preset_or_dir),
        pool,
        scheduler_config=config.scheduler_config(),
        planner=planner,
        model_name=mcfg.name,
        loaded_model=loaded,
        max_model_len=max_model_len,
        kv_offload=offload,
        prefill_graphs=prefill_graphs,
        decode_graphs=decode_graphs,
        recurrence_kernels=recurrence_kernels,
    )


def build_hisparse(config: EngineConfig, max_model_len: int, device: torch.device, dtype: torch.dtype,
                   fingerprint: str = ""):
    """The engine's HiSparseOffload: blocks in the kvstore daemon at `hisparse_store`, or
    in this process's memory when it is None."""
    from engine.hisparse.daemon_store import DaemonBlockStore
    from engine.hisparse.offload import HiSparseOffload
    from kvstore.errors import KVStoreError

    store = None
    if config.hisparse_store is not None:
        try:
            store = DaemonBlockStore(config.hisparse_store or None)
        except KVStoreError as exc:
            raise InvalidRequestError("hisparse_store", f"cannot reach the kvstore daemon: {exc}") from None
    return HiSparseOffload(config.hisparse, store, config.max_num_seqs, max_model_len, device, dtype, fingerprint)
