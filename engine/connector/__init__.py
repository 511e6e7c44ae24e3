"""The store connector: position-independent caching over the kvstore daemon.

`StoreSignatureCache` implements engine.pic's `SignatureCache` over a kvstore daemon
(batch lookups, zero-copy loads from the tier holding each segment, asynchronous puts,
in-flight dedup across engines, fallback to recomputation when the daemon is away);
`StorePicPlanner` is the PIC planner that drives it (prefetch at admission, loads
overlapped with compute, puts after prefill); `attach_store` installs both in an engine.
See docs/integration.md.
"""
from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorError, StoreUnavailable

__all__ = ["StoreConnectorConfig", "ConnectorError", "StoreUnavailable"]
