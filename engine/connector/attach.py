"""Installing the store connector in a built engine: `attach_store`, and `store_config`
(the `--store [SOCKET]` option of `kvengine run` / `kvengine serve` -> a config).

    engine = build_engine("qwen3next-tiny")
    planner = attach_store(engine, PicConfig(method="pic"), StoreConnectorConfig(socket=...))
    ...
    planner.store.close()      # finishes queued puts, releases leases, disconnects

Only the `pic` and `naive` methods keep signatures, so only they use the store; `full`
computes everything and `prefix` keeps its radix tree in the engine's process.
"""
from __future__ import annotations

from typing import Optional

from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorConfigError
from engine.connector.planner import StorePicPlanner
from engine.connector.store_cache import StoreSignatureCache
from engine.pic.config import PicConfig
from engine.pic.planner import anchor_for

STORE_METHODS = ("pic", "naive")


def store_config(value: Optional[str], **overrides) -> Optional[StoreConnectorConfig]:
    """The connector config of a `--store` value: None (option absent) -> None (keep the
    in-process cache); "" (given without a value) -> the daemon's default socket; else
    the socket path."""
    if value is None:
        return None
    return StoreConnectorConfig(socket=value or None, **overrides)


def attach_store(engine, pic_config: PicConfig, connector: StoreConnectorConfig) -> StorePicPlanner:
    """Install a `StorePicPlanner` over a new `StoreSignatureCache` in `engine` (an
    LLMEngine built by engine.builder). Never fails for a missing daemon: the engine
    then serves by recomputation and connects when the daemon appears."""
    if pic_config.method not in STORE_METHODS:
        raise ConnectorConfigError(
            f"method={pic_config.method!r} keeps nothing in the store; --store serves methods {', '.join(STORE_METHODS)}")
    fingerprint = engine.loaded_model.fingerprint
    cache = StoreSignatureCache(fingerprint, engine.device, connector)
    planner = StorePicPlanner(pic_config, engine.runner.model.config, fingerprint,
                              anchor_for(pic_config, engine.tokenizer), cache, engine.device,
                              prefetch_queued=connector.prefetch_queued, model_dtype=engine.runner.model.dtype)
    planner.attach_queue(engine.scheduler.waiting)
    engine.scheduler.planner = planner
    return planner
