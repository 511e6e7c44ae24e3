"""The Store's media: the cache directory and its lock, the enabled tiers, the LMDB index.

`StoreMedia.open` takes the cache directory for this process (an exclusive flock on
DIR/kvstore.lock holding the daemon's pid: a second daemon on the same directory is
refused with the holder's pid), builds and opens the tiers the settings enable (from
kvstore.tiers.registry, fastest first) and, when a durable tier is enabled, opens the
index: a damaged one is rebuilt from the object files' headers or refused, as
`StoreSettings.index_recovery` says. `close` undoes it in reverse order. What lies in the
media (objects, leases, reservations) is the Store's business, not this module's.

Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

from kvstore.errors import AlreadyExists, IndexDamaged, InvalidRequest, StorageError
from kvstore.index import ObjectIndex
from kvstore.records import StoreSettings
from kvstore.recovery import scan_object_files
from kvstore.tiers.base import Tier
from kvstore.tiers.nvme import check_private_dir
from kvstore.tiers.registry import TIERS, TierRoles

log = logging.getLogger(__name__)


class StoreMedia:
    """The opened directory, tiers and index of one Store (module docstring)."""

    def __init__(self, settings: StoreSettings, wrap_tier: Optional[Callable[[Tier], Tier]],
                 counters: Counter) -> None:
        self.settings = settings
        self.dir = Path(settings.dir)
        self._wrap = wrap_tier
        self._counters = counters
        self.tiers: dict[str, Tier] = {}  # enabled tiers, fastest first (filled by open, emptied by close)
        self.roles: TierRoles = TIERS.roles(())
        self.index: Optional[ObjectIndex] = None
        self._dir_lock = -1

    def open(self) -> None:
        """Lock the directory, open the tiers and (with a durable tier) the index; on a
        failure whatever was opened is closed again."""
        self._lock_dir()
        try:
            self._open_tiers()
            if self.roles.durable is not None:
                self._open_index()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the index, then the tiers (slowest first), then unlock the directory.
        Idempotent; a tier that fails to close is logged and the rest still close."""
        if self.index is not None:
            self.index.close()
            self.index = None
        for t in reversed(list(self.tiers.values())):
            try:
                t.close()
            except Exception as exc:  # noqa: BLE001 - close the rest regardless
                log.warning("closing tier %s failed: %s", t.name, exc)
        self.tiers.clear()
        self.roles = TIERS.roles(())
        if self._dir_lock >= 0:
            os.close(self._dir_lock)
            self._dir_lock = -1

    def _lock_dir(self) -> None:
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_private_dir(self.dir, "cache directory", follow=True, make_private=False)
            fd = os.open(self.dir / "kvstore.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StorageError(f"cannot use the cache directory {self.dir}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise AlreadyExists(f"cache directory {self.dir} is in use by another daemon (pid {holder or '?'}); "
                                "stop it first or pass another --dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._dir_lock = fd

    def _open_tiers(self) -> None:
        made: list[Tier] = TIERS.build(self.settings, self.dir)
        if not made:
            raise InvalidRequest("no tier enabled: every capacity is 0 (or gpu only, without CUDA)")
        for t in made:
            tier = self._wrap(t) if self._wrap else t
            tier.open()
            self.tiers[tier.name] = tier
        self.roles = TIERS.roles(self.tiers)

    def _open_index(self) -> None:
        """Open the LMDB index; a damaged one is rebuilt from the object files' headers
        (settings.index_recovery "rebuild") or refused with the repair command to run."""
        objects = self.dir / "objects"
        self.index = ObjectIndex(self.dir / "index.lmdb", rebuild_source=lambda: scan_object_files(objects).records)
        try:
            self.index.open()
        except IndexDamaged as exc:
            if self.settings.index_recovery != "rebuild":
                raise IndexDamaged(f"{exc}; rebuild it from the object files with: kvstore repair --dir {self.dir}") \
                    from None
            log.warning("%s; moving it aside and rebuilding it from the object files", exc)
            n = self.index.rebuild(str(exc))
            self._counters["index_rebuilds"] += 1
            log.warning("index %s rebuilt from %d object files (the damaged one is at %s)", self.index.path, n,
                        self.index.moved_aside[-1] if self.index.moved_aside else "-")
