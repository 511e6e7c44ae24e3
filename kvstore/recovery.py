"""Rebuilding the NVMe tier's index from its object files, and `kvstore repair`.

Every sealed object file ends in a header record (kvstore.objheader) that says which key
it holds, its size, checksum and meta. `scan_object_files` reads those records and sorts
the files into: live objects (one index record per key; when several live files hold one
key, the newest), superseded copies, dropped objects (marked dead, due for deletion) and
files without a readable header (never deleted: set aside in `objects/quarantine/`).

The daemon uses it to rebuild a missing, truncated or corrupt index at open and while
running (kvstore.index), and to adopt files the index does not know (kvstore.placement);
`repair` does the same offline for `kvstore repair --dir DIR`.
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from kvstore.allocator import PAGE_SIZE
from kvstore.errors import AlreadyExists, BadObject, StorageError
from kvstore.index import IndexRecord, ObjectIndex
from kvstore.objheader import Trailer, read_trailer
from kvstore.tiers.nvme import NvmeTier

log = logging.getLogger(__name__)

INDEX_DIR = "index.lmdb"
OBJECTS_DIR = "objects"
LOCK_FILE = "kvstore.lock"


def _rounded(n: int) -> int:
    return (n + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE


def record_from_trailer(root: Path, path: str, trailer: Trailer) -> IndexRecord:
    """The index record of a live object file, from its header (hits start at 0)."""
    h = trailer.header
    return IndexRecord(h.key, "nvme", os.path.relpath(path, root), 0, _rounded(h.size), h.size, h.checksum,
                       h.fingerprint, h.token_count, h.cost, dict(h.extra), h.created, h.created, 0)


@dataclass
class FileScan:
    """What `scan_object_files` found."""

    records: list[IndexRecord] = field(default_factory=list)  # live objects, one per key
    superseded: list[str] = field(default_factory=list)  # live files of a key a newer file holds
    dead: list[str] = field(default_factory=list)  # files of dropped objects
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (path, why): no usable header


def scan_object_files(root: Path, paths: Iterable[str] | None = None) -> FileScan:
    """Read the header of every object file under `root` (or of `paths` only)."""
    root = Path(root)
    if paths is None:
        paths = [s.path for s in NvmeTier(root, 1).list_sealed()]
    out = FileScan()
    newest: dict[bytes, tuple[float, IndexRecord]] = {}
    for path in paths:
        try:
            trailer = read_trailer(path)
        except FileNotFoundError:
            continue  # deleted while we scanned
        except (OSError, BadObject) as exc:
            out.unreadable.append((path, str(exc)))
            continue
        if trailer is None:
            out.unreadable.append((path, "no object header (a file of the old layout or not an object file)"))
            continue
        if not trailer.live:
            out.dead.append(path)
            continue
        rec = record_from_trailer(root, path, trailer)
        prev = newest.get(rec.key)
        if prev is None or rec.created > prev[0]:
            if prev is not None:
                out.superseded.append(str(root / prev[1].file))
            newest[rec.key] = (rec.created, rec)
        else:
            out.superseded.append(path)
    out.records = [r for _, r in newest.values()]
    return out


@dataclass(frozen=True)
class RepairReport:
    """What `repair` did."""

    records: int  # index records written (live objects)
    set_aside: int  # files moved to objects/quarantine/ (unreadable headers, superseded copies)
    dead_removed: int  # files of dropped objects deleted
    old_index: str  # where the previous index was moved ("" when there was none)

    def line(self, directory: Path) -> str:
        moved = f"; the old index is at {self.old_index}" if self.old_index else ""
        return (f"rebuilt the index of {directory} from its object files: {self.records} objects, "
                f"{self.set_aside} files set aside in {directory / OBJECTS_DIR / 'quarantine'}, "
                f"{self.dead_removed} dropped files removed{moved}")


def repair(directory: Path) -> RepairReport:
    """Rebuild `directory`'s index from its object files (the daemon must be stopped):
    the old index is moved aside, never deleted; files without a usable header are set
    aside. AlreadyExists when a daemon holds the directory."""
    directory = Path(directory)
    objects = directory / OBJECTS_DIR
    if not objects.is_dir():
        raise StorageError(f"{directory} holds no {OBJECTS_DIR}/ directory: not a kvstore cache directory")
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AlreadyExists(f"cache directory {directory} is in use by a running daemon; stop it first") from None
        tier = NvmeTier(objects, 1)
        scan = scan_object_files(objects)
        index = ObjectIndex(directory / INDEX_DIR, rebuild_source=lambda: scan.records)
        n = index.rebuild("kvstore repair")
        index.close()
        aside = 0
        for path in [p for p, _ in scan.unreadable] + scan.superseded:
            try:
                tier.set_aside(path)
                aside += 1
            except OSError as exc:
                log.warning("cannot set %s aside: %s", path, exc)
        removed = 0
        for path in scan.dead:
            try:
                os.unlink(path)
                removed += 1
            except OSError as exc:
                log.warning("cannot remove the dropped object file %s: %s", path, exc)
        old = str(index.moved_aside[-1]) if index.moved_aside else ""
        return RepairReport(n, aside, removed, old)
    finally:
        os.close(fd)
