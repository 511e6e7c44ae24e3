"""Rebuilding the durable (NVMe) tier's objects at open: `recover_durable` fills a
Placement's object map from the index, drops records whose file is missing, short or
holds another object (`record_mismatch`), adopts the object files the index does not
name from their headers (kvstore.recovery.scan_object_files), deletes dropped objects'
files and sets unreadable or superseded ones aside. Called by the Store under its lock,
before the store opens."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kvstore.errors import BadObject
from kvstore.index import IndexRecord
from kvstore.objheader import read_trailer
from kvstore.placement import Placement, StoredObject
from kvstore.records import ObjectMeta
from kvstore.recovery import scan_object_files
from kvstore.tiers.base import Slot

log = logging.getLogger(__name__)


def recover_durable(place: Placement) -> None:
    """Rebuild the NVMe tier's objects from the index, then adopt the object files it
    does not name from their headers (a crash between a file's rename and its index
    commit, or an index rebuilt or lost): no object file is deleted because the index
    does not know it. Dropped objects' files (marked dead) are deleted; files without
    a usable header, and superseded copies of a key, are set aside in quarantine/."""
    assert place.index is not None and place.roles.durable is not None
    durable = place.roles.durable
    nvme = place.tiers[durable]
    root = place.objects_root
    drop: list[bytes] = []
    live: set[str] = set()
    for rec in place.index.items():
        path = root / rec.file
        why = record_mismatch(rec, path)
        if why:
            log.warning("index: object %r file %s %s; dropping its record", rec.key, path, why)
            drop.append(rec.key)
            continue
        slot = Slot(durable, rec.offset, rec.length, rec.size, str(path))
        nvme.adopt(slot)
        live.add(str(path))
        meta = ObjectMeta(rec.fingerprint, rec.token_count, rec.cost, rec.extra)
        place.objects[rec.key] = StoredObject(rec.key, durable, slot, rec.checksum, meta, rec.created,
                                             rec.last_access, rec.hits, verified=False)
    drop += place.index.bad_keys
    place.index.delete_many(drop)
    place.counters["recovery_dropped"] += len(drop)
    place.counters["recovered_objects"] += len(place.objects)
    scan = scan_object_files(root, [s.path for s in nvme.list_sealed() if s.path not in live])
    adopted = []
    for rec in scan.records:
        if rec.key in place.objects:
            scan.superseded.append(str(root / rec.file))
            continue
        path = str(root / rec.file)
        slot = Slot(durable, 0, rec.length, rec.size, path)
        nvme.adopt(slot)
        meta = ObjectMeta(rec.fingerprint, rec.token_count, rec.cost, rec.extra)
        place.objects[rec.key] = StoredObject(rec.key, durable, slot, rec.checksum, meta, rec.created,
                                             rec.last_access, 0, verified=False)
        adopted.append(rec)
    if adopted:
        log.warning("nvme: adopted %d object files the index did not name (from their headers)", len(adopted))
        place.index.put_many(adopted)
    place.counters["recovered_from_files"] += len(adopted)
    for path in scan.dead:
        Path(path).unlink(missing_ok=True)
        place.counters["orphans_removed"] += 1  # files of dropped objects
    for path, why in scan.unreadable + [(p, "a newer file holds the same key") for p in scan.superseded]:
        try:
            dst = nvme.set_aside(path)
            log.warning("nvme: %s: %s; set aside as %s (not deleted)", path, why, dst)
            place.counters["files_set_aside"] += 1
        except OSError as exc:
            log.warning("nvme: %s: %s; cannot set it aside: %s", path, why, exc)
    place.counters["partial_writes_removed"] += nvme.discard_unsealed()

def record_mismatch(rec: IndexRecord, path: Path) -> str:
    """Why `rec` cannot be served from `path` ("" when it can): the file is missing,
    short, or its header names another object."""
    try:
        on_disk = os.lstat(path).st_size
    except FileNotFoundError:
        return "is missing"
    if on_disk == rec.size:
        return ""  # a file of the old layout (no header)
    try:
        t = read_trailer(str(path))
    except (OSError, BadObject) as exc:
        return f"has a damaged header ({exc})"
    if t is None or t.header.size != rec.size or on_disk != rec.size + t.nbytes:
        return f"is {on_disk} bytes, not {rec.size} plus a header"
    if t.header.key != rec.key or t.header.checksum != rec.checksum or not t.live:
        return "holds another or a dropped object"
    return ""
