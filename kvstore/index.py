"""The durable object index: LMDB under `<dir>/index.lmdb`.

It is the source of truth for the NVMe tier. One record per durable object, key ->
msgpack-encoded `IndexRecord`, in the sub-database "objects"; the sub-database "meta"
holds the schema version (a different one raises VersionMismatch at open rather than
misreading records).

Commit protocol (enforced by the Store): an object's bytes are fsync'ed and renamed to
their final file first, then its record is written in one LMDB transaction (LMDB commits
are atomic and, with sync on, durable). So after a crash the index never names a file
that was not completely written; a file without a record is an orphan the Store deletes
at the next open. Memory-tier objects are not recorded (they do not survive a restart).

Hits and last-access times change on every get; they are kept in memory by the Store and
written back in one transaction by `put_many` at close (and when a record is rewritten).

Thread-safety: LMDB serialises write transactions itself; any thread may call any method.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import lmdb
import msgpack

from kvstore.errors import StorageError, VersionMismatch

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_SCHEMA_KEY = b"schema_version"


@dataclass(frozen=True)
class IndexRecord:
    """Everything needed to serve a durable object after a restart."""

    key: bytes
    tier: str
    file: str  # path relative to the tier's root, e.g. "ab/ab12....obj"
    offset: int
    length: int  # bytes the object occupies in its tier (4 KiB rounded)
    size: int  # object bytes
    checksum: int
    fingerprint: str = ""
    token_count: int = 0
    cost: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    last_access: float = 0.0
    hits: int = 0

    def encode(self) -> bytes:
        d = asdict(self)
        del d["key"]
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> "IndexRecord":
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        return cls(key=key, **d)


class ObjectIndex:
    """LMDB-backed map key -> IndexRecord; see the module docstring."""

    def __init__(self, path: Path, map_size: int = 1 << 30) -> None:
        self.path = Path(path)
        self._map_size = map_size
        self._env: lmdb.Environment | None = None
        self._objects: Any = None

    def open(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path), map_size=self._map_size, max_dbs=4, subdir=True,
                sync=True, metasync=True, lock=True, mode=0o600,
            )
        except lmdb.Error as exc:
            raise StorageError(f"cannot open the index {self.path}: {exc}") from exc
        meta = self._env.open_db(b"meta")
        self._objects = self._env.open_db(b"objects")
        with self._env.begin(write=True, db=meta) as txn:
            raw = txn.get(_SCHEMA_KEY)
            if raw is None:
                txn.put(_SCHEMA_KEY, str(SCHEMA_VERSION).encode())
            elif int(raw) != SCHEMA_VERSION:
                found = int(raw)
                self.close()
                raise VersionMismatch(
                    f"index {self.path} has schema version {found}, this daemon reads version {SCHEMA_VERSION}"
                )

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def _write(self, fn: Any) -> None:
        """Run fn(txn) in one write transaction, growing the map when it is full."""
        assert self._env is not None, "index is not open"
        for _ in range(8):
            try:
                with self._env.begin(write=True, db=self._objects) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                new = self._env.info()["map_size"] * 2
                log.info("index %s full; growing the map to %d bytes", self.path, new)
                self._env.set_mapsize(new)
            except lmdb.Error as exc:
                raise StorageError(f"index {self.path} write failed: {exc}") from exc
        raise StorageError(f"index {self.path} cannot grow its map further")

    def put(self, rec: IndexRecord) -> None:
        """Durably record one object (the transaction is committed when this returns)."""
        self._write(lambda txn: txn.put(rec.key, rec.encode()))

    def put_many(self, recs: Sequence[IndexRecord]) -> None:
        """Record many objects in one transaction."""
        if recs:
            self._write(lambda txn: [txn.put(r.key, r.encode()) for r in recs])

    def delete(self, key: bytes) -> None:
        self._write(lambda txn: txn.delete(key))

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._write(lambda txn: [txn.delete(k) for k in keys])

    def get(self, key: bytes) -> IndexRecord | None:
        assert self._env is not None, "index is not open"
        with self._env.begin(db=self._objects) as txn:
            raw = txn.get(key)
        return None if raw is None else IndexRecord.decode(key, raw)

    def items(self) -> Iterator[IndexRecord]:
        """Every record (a read snapshot). Undecodable records are logged and skipped,
        and listed by `bad_keys` so the caller can drop them."""
        assert self._env is not None, "index is not open"
        self.bad_keys: list[bytes] = []
        with self._env.begin(db=self._objects) as txn:
            for k, raw in txn.cursor():
                try:
                    yield IndexRecord.decode(bytes(k), bytes(raw))
                except Exception as exc:  # noqa: BLE001 - a corrupt record must not stop recovery
                    log.warning("index record %r does not decode (%s); dropping it", bytes(k), exc)
                    self.bad_keys.append(bytes(k))

    def __len__(self) -> int:
        assert self._env is not None, "index is not open"
        with self._env.begin(db=self._objects) as txn:
            return txn.stat(self._objects)["entries"]
