"""The store connector: position-independent caching over the kvstore daemon.

`StoreSignatureCache` implements engine.pic's `SignatureCache` over a kvstore daemon
(batch lookups, zero-copy loads from the tier holding each segment, asynchronous puts,
in-flight dedup across engines, fallback to recomputation when the daemon is away);
`DaemonSegmentStore` (engine.connector.daemon_store) is engine.pic's `SegmentStore` over
it (prefetch at admission, loads overlapped with compute, claims, cold sharing, puts
after prefill), which the engine's `PicPlanner` calls; `attach_store` installs both.
See docs/integration.md.
"""
from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorError, StoreUnavailable

__all__ = ["StoreConnectorConfig", "ConnectorError", "StoreUnavailable"]
