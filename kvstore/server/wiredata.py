"""The over-the-wire data path: PutBytes and GetBytes, for clients on another host.

Owns: copying an object's bytes between a gRPC message and the daemon's own region (a
shared-memory arena window or an object file), the checksum the daemon computes for
bytes it wrote itself, and the message-size bound of a GetBytes answer. A TCP client
never sees a Region: it sends and receives bytes, so it cannot write through (or read)
shared memory of the daemon's host, and cannot commit bytes it never sent.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Optional

from kvstore import checksums as cks
from kvstore import errors
from kvstore.records import Region

SERVER_CLIENT_ID = "kvstore-daemon-wire"  # the owner of the short leases GetBytes takes
MESSAGE_SLACK = 64 << 10  # room for keys and metadata beside the bytes of a GetBytes answer


def _window(fd: int, region: Region, writable: bool) -> tuple[mmap.mmap, int]:
    start = region.offset - region.offset % mmap.ALLOCATIONGRANULARITY
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, region.offset + region.length - start, prot=prot, offset=start), region.offset - start


def _check(region: Region, what: str) -> None:
    if region.kind not in ("shm", "file"):
        raise errors.InvalidRequest(f"{what} over the wire serves the cpu and nvme tiers; this object's bytes "
                                    f"are in a {region.kind!r} region")


def write_region(region: Region, data: Any) -> int:
    """Write `data` (bytes-like, exactly region.length bytes) into the daemon's region;
    returns the store checksum of the bytes written."""
    _check(region, "PutBytes")
    mv = memoryview(data).cast("B")
    if mv.nbytes != region.length:
        raise errors.InvalidRequest(f"PutBytes: {mv.nbytes} bytes for a region of {region.length}")
    fd = os.open(region.path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        if region.kind == "file":
            done = 0
            while done < mv.nbytes:
                done += os.pwrite(fd, mv[done:], region.offset + done)
        else:
            mm, at = _window(fd, region, writable=True)
            try:
                mm[at:at + mv.nbytes] = mv
            finally:
                mm.close()
    finally:
        os.close(fd)
    return cks.host_checksum(mv)


def read_region(region: Region) -> bytes:
    """A copy of the bytes of one of the daemon's regions."""
    _check(region, "GetBytes")
    fd = os.open(region.path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if region.offset + region.length > os.fstat(fd).st_size:
            raise errors.BadObject(f"region of {region.length} bytes at {region.offset} lies past the end of "
                                   f"{region.path}")
        if region.kind == "file":
            return os.pread(fd, region.length, region.offset)
        mm, at = _window(fd, region, writable=False)
        try:
            return mm[at:at + region.length]
        finally:
            mm.close()
    finally:
        os.close(fd)


def check_answer_size(sizes: list[Optional[int]], max_message_bytes: int) -> None:
    """InvalidRequest when objects of `sizes` (None: a miss) cannot travel in one message."""
    total = sum(s for s in sizes if s)
    if total + MESSAGE_SLACK > max_message_bytes:
        raise errors.InvalidRequest(
            f"GetBytes: the {sum(1 for s in sizes if s)} objects hold {total} bytes, over what one message of "
            f"{max_message_bytes} bytes carries; ask for fewer keys per call")
