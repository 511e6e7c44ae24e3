"""The kvstore client library: `KVStoreClient` (blocking) and `AsyncKVStoreClient`
(asyncio) with the same API, the zero-copy views a get returns, and the result records.
Every failure is a kvstore.errors class (never a raw gRPC error)."""

from kvstore.client.aio import AsyncKVStoreClient
from kvstore.client.common import DaemonInfo, PutResult, ShowResult
from kvstore.client.sync import KVStoreClient
from kvstore.client.views import ObjectView, TensorsView

__all__ = ["KVStoreClient", "AsyncKVStoreClient", "ObjectView", "TensorsView", "PutResult", "ShowResult",
           "DaemonInfo"]
