"""Installing the store connector in a built engine: `attach_store`, and `store_config`
(the `--store [SOCKET]` option of `kvengine run` / `kvengine serve` -> a config).

    engine = build_engine("qwen3next-tiny")
    planner = attach_store(engine, PicConfig(method="pic"), StoreConnectorConfig(socket=...))
    ...
    planner.store.close()      # finishes queued puts, releases leases, disconnects

`pic` and `naive` keep signatures in the store, `pic` also its exact-prefix checkpoints;
`prefix` keeps its checkpoints there (engine.connector.prefix_planner: the same objects
as pic's exact prefixes); `full` computes everything and keeps nothing.
"""
from __future__ import annotations

from typing import Optional

from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorConfigError
from engine.connector.daemon_store import prefix_variant, store_pic_planner
from engine.connector.prefix_planner import StorePrefixPlanner
from engine.connector.prefix_store import PrefixCheckpointStore
from engine.connector.store_cache import StoreSignatureCache
from engine.pic.config import PicConfig
from engine.pic.prefix import PrefixTree

STORE_METHODS = ("pic", "naive", "prefix")


def store_config(value: Optional[str], **overrides) -> Optional[StoreConnectorConfig]:
    """The connector config of a `--store` value: None (option absent) -> None (keep the
    in-process cache); "" (given without a value) -> the daemon's default socket; else
    the socket path."""
    if value is None:
        return None
    return StoreConnectorConfig(socket=value or None, **overrides)


def attach_store(engine, pic_config: PicConfig, connector: StoreConnectorConfig):
    """Install a `PicPlanner` over a `DaemonSegmentStore` (pic, naive) or a
    `StorePrefixPlanner` (prefix) over a new `StoreSignatureCache` in `engine` (an
    LLMEngine built by engine.builder). Never fails for a missing daemon: the engine then
    serves by recomputation and connects when the daemon appears."""
    if pic_config.method not in STORE_METHODS:
        raise ConnectorConfigError(
            f"method={pic_config.method!r} keeps nothing in the store; --store serves methods {', '.join(STORE_METHODS)}")
    fingerprint = engine.loaded_model.fingerprint
    cache = StoreSignatureCache(fingerprint, engine.device, connector)
    if pic_config.method == "prefix":
        planner = StorePrefixPlanner(pic_config, PrefixTree(pic_config.prefix_cache_bytes), engine.device, cache,
                                     PrefixCheckpointStore(cache, fingerprint, prefix_variant(engine.runner.model.dtype)))
        engine.scheduler.planner = planner
        engine.sync_timings = pic_config.sync_timing
        return planner
    planner = store_pic_planner(pic_config, engine.runner.model, fingerprint, engine.tokenizer, cache,
                                prefetch_queued=connector.prefetch_queued)
    planner.attach_queue(engine.scheduler.waiting)
    engine.scheduler.planner = planner
    return planner
