"""The durable object index: LMDB under `<dir>/index.lmdb`.

It is the source of truth for the NVMe tier. One record per durable object, key ->
msgpack-encoded `IndexRecord`, in the sub-database "objects"; the sub-database "meta"
holds the schema version (a different one raises VersionMismatch at open rather than
misreading records).

Commit protocol (enforced by the Store): an object's bytes, followed by its header record
(kvstore.objheader: key, size, checksum, meta), are fsync'ed and renamed to their final
file first, then its record is written in one LMDB transaction (LMDB commits are atomic
and, with sync on, durable). So after a crash the index never names a file that was not
completely written, and a file without a record is adopted from its header at the next
open (kvstore.recovery): no object file is ever deleted because the index does not know
it. Memory-tier objects are not recorded (they do not survive a restart).

Damage: LMDB maps data.mdb, and touching a page past the end of a truncated file kills
the process with SIGBUS. `open` therefore checks the file against its meta pages first
(`check_files`) and reads every record once; a truncated, foreign or unreadable index
raises IndexDamaged, and the Store rebuilds it from the object files (`rebuild`: the old
one is moved aside, never deleted) or refuses to start, as configured. While running,
every transaction first checks that data.mdb and lock.mdb did not shrink (LMDB never
shrinks them) and rebuilds the index when they did.

Thread-safety: LMDB serialises write transactions itself; any thread may call any method
(a rebuild waits for the transactions under way and holds new ones back).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import lmdb
import msgpack

from kvstore.errors import IndexDamaged, StorageError, VersionMismatch

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

    def __init__(self, path: Path, map_size: int = 1 << 30,
                 rebuild_source: Optional[Callable[[], Iterable[IndexRecord]]] = None) -> None:
        self.path = Path(path)
        self._map_size = map_size
        self._env: lmdb.Environment | None = None
        self._objects: Any = None
        self._rebuild_source = rebuild_source
        self._gate = _Gate()
        self._files: dict[str, tuple[int, int]] = {}  # name -> (fd, smallest size it may have)
        self.moved_aside: list[Path] = []
        self.bad_keys: list[bytes] = []

    # -- health ------------------------------------------------------------------------
    def check_files(self) -> None:
        """IndexDamaged naming what is wrong with data.mdb before LMDB maps it (a mapping
        shorter than LMDB's last committed page faults with SIGBUS on first touch).
        Nothing to check when the index does not exist yet."""
        data = self.path / "data.mdb"
        try:
            fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise IndexDamaged(f"index {self.path}: cannot open data.mdb: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 2 * MAX_PAGE, 0)
        finally:
            os.close(fd)
        need = lmdb_needed_bytes(head, size)
        if need is None:
            raise IndexDamaged(f"index {self.path}: data.mdb ({size} bytes) has no valid LMDB meta page")
        if size < need:
            raise IndexDamaged(f"index {self.path}: data.mdb is {size} bytes, its last committed page needs {need} "
                               f"(truncated)")

    def _watch(self) -> None:
        """Keep data.mdb and lock.mdb open to notice a truncation while running."""
        self._unwatch()
        for name in ("data.mdb", "lock.mdb"):
            fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW)
            self._files[name] = (fd, os.fstat(fd).st_size)

    def _unwatch(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def _shrunk(self) -> Optional[str]:
        """Why the mapped files are no longer safe to touch (None when they are): LMDB
        never shrinks them, so a file now shorter than it was has been truncated."""
        for name, (fd, least) in self._files.items():
            size = os.fstat(fd).st_size
            if size < least:
                return f"index {self.path}: {name} shrank from {least} to {size} bytes while the daemon ran (truncated)"
        return None

    def _grew(self) -> None:
        fd, _ = self._files["data.mdb"]
        self._files["data.mdb"] = (fd, os.fstat(fd).st_size)

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Open (or create) the index. IndexDamaged when data.mdb is truncated, is not an
        LMDB file, or a record cannot be read (check_files, then a full read pass)."""
        self.check_files()
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path), map_size=self._map_size, max_dbs=4, subdir=True,
                sync=True, metasync=True, lock=True, mode=0o600,
            )
        except lmdb.InvalidError as exc:
            raise IndexDamaged(f"index {self.path} is not a readable LMDB environment: {exc}") from None
        except lmdb.Error as exc:
            raise StorageError(f"cannot open the index {self.path}: {exc}") from exc
        try:
            meta = self._env.open_db(b"meta")
            self._objects = self._env.open_db(b"objects")
            with self._env.begin(write=True, db=meta) as txn:
                raw = txn.get(_SCHEMA_KEY)
                if raw is None:
                    txn.put(_SCHEMA_KEY, str(SCHEMA_VERSION).encode())
                elif int(raw) != SCHEMA_VERSION:
                    found = int(raw)
                    raise VersionMismatch(
                        f"index {self.path} has schema version {found}, this daemon reads version {SCHEMA_VERSION}"
                    )
            with self._env.begin(db=self._objects) as txn:  # every page read once: damage shows here
                for _k, _v in txn.cursor():
                    pass
            self._watch()
        except lmdb.Error as exc:
            self.close()
            raise IndexDamaged(f"index {self.path} cannot be read: {type(exc).__name__}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._unwatch()
        if self._env is not None:
            self._env.close()
            self._env = None

    def rebuild(self, reason: str) -> int:
        """Move the index aside (to `index.lmdb.damaged-<time>`, never deleted), create a
        fresh one and fill it from `rebuild_source` (the object files' headers); returns
        how many records it holds. `reason` is logged by the caller and kept in errors."""
        if self._rebuild_source is None:
            raise IndexDamaged(f"{reason}; no source to rebuild it from")
        with self._gate.exclusive():
            return self._rebuild_locked()

    def _rebuild_locked(self) -> int:
        assert self._rebuild_source is not None
        self.close()
        if self.path.exists():
            aside = self.path.with_name(f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            os.rename(self.path, aside)
            self.moved_aside.append(aside)
        self.open()
        recs = list(self._rebuild_source())
        if recs:
            self._write_unguarded(lambda txn: [txn.put(r.key, r.encode()) for r in recs])
        return len(recs)

    def _heal_if_shrunk(self) -> None:
        """Called before each transaction: a truncated index is rebuilt before LMDB
        touches a page that is gone (a truncation racing a transaction already under way
        can still fault; the next open then finds and rebuilds it)."""
        if self._shrunk() is None:
            return
        with self._gate.exclusive():
            why = self._shrunk()  # another thread may have rebuilt it meanwhile
            if why is not None:
                log.error("%s; moving it aside and rebuilding it from the object files", why)
                self._rebuild_locked()

    # -- transactions ----------------------------------------------------------------
    def _write(self, fn: Any) -> None:
        """Run fn(txn) in one write transaction, growing the map when it is full."""
        assert self._env is not None, "index is not open"
        self._heal_if_shrunk()
        with self._gate.shared():
            self._write_unguarded(fn)

    def _write_unguarded(self, fn: Any) -> None:
        assert self._env is not None, "index is not open"
        for _ in range(8):
            try:
                with self._env.begin(write=True, db=self._objects) as txn:
                    fn(txn)
                self._grew()
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
        self._heal_if_shrunk()
        with self._gate.shared(), self._env.begin(db=self._objects) as txn:
            raw = txn.get(key)
        return None if raw is None else IndexRecord.decode(key, raw)

    def items(self) -> Iterator[IndexRecord]:
        """Every record (a read snapshot). Undecodable records are logged and skipped,
        and listed by `bad_keys` so the caller can drop them."""
        assert self._env is not None, "index is not open"
        self._heal_if_shrunk()
        self.bad_keys = []
        with self._gate.shared():
            with self._env.begin(db=self._objects) as txn:
                rows = [(bytes(k), bytes(raw)) for k, raw in txn.cursor()]
        for k, raw in rows:
            try:
                yield IndexRecord.decode(k, raw)
            except Exception as exc:  # noqa: BLE001 - a corrupt record must not stop recovery
                log.warning("index record %r does not decode (%s); dropping it", k, exc)
                self.bad_keys.append(k)

    def __len__(self) -> int:
        assert self._env is not None, "index is not open"
        self._heal_if_shrunk()
        with self._gate.shared(), self._env.begin(db=self._objects) as txn:
            return txn.stat(self._objects)["entries"]


MAX_PAGE = 64 << 10  # the largest LMDB page size
_META = struct.Struct("<II")  # mm_magic, mm_version, at byte 16 of a meta page (after the page header)
_LMDB_MAGIC = 0xBEEFC0DE


def lmdb_needed_bytes(head: bytes, size: int) -> Optional[int]:
    """From the first bytes of a data.mdb (its two meta pages, 64-bit LMDB 0.9 layout):
    the file size its newest valid meta page needs ((last page + 1) x page size), or None
    when neither meta page is valid. Layout of a meta page: a 16-byte page header, then
    mm_magic u32, mm_version u32, mm_address u64, mm_mapsize u64, two 48-byte MDB_db
    records (the first one's leading u32 is the page size), mm_last_pg u64, mm_txnid u64."""
    best: Optional[tuple[int, int]] = None  # (txnid, needed bytes)
    if len(head) < 152:
        return None
    psize = struct.unpack_from("<I", head, 40)[0]
    if psize < 512 or psize > MAX_PAGE or psize & (psize - 1):
        return None
    for off in (0, psize):
        if off + 152 > len(head):
            return None  # the second meta page is missing: LMDB would read past the end
        magic, version = _META.unpack_from(head, off + 16)
        if magic != _LMDB_MAGIC or version != 1:
            continue
        last_pg, txnid = struct.unpack_from("<QQ", head, off + 136)
        need = (last_pg + 1) * psize
        if best is None or txnid > best[0]:
            best = (txnid, max(need, 2 * psize))
    return None if best is None else best[1]


class _Gate:
    """Many transactions at once (shared), or one rebuild alone (exclusive)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._closed = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._closed = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()
