"""The kvstore exception hierarchy: every error the store, its tiers, the object format,
the server and the client library raise on purpose derives from `KVStoreError`.

Each message names the bad value (the key, the size, the tier, the version), so a CLI can
print `str(exc)` as its one-line reason. The server maps each class to one gRPC status
code and the client library maps it back (see `kvstore/server/`), so `code` is a stable,
wire-safe name for each class.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every kvstore error."""

    code = "KVSTORE_ERROR"


class DaemonNotRunning(KVStoreError):
    """No daemon answers on the given socket or address."""

    code = "DAEMON_NOT_RUNNING"


class UnknownKey(KVStoreError):
    """The key, lease or reservation id names nothing the store holds."""

    code = "UNKNOWN_KEY"


class CapacityExhausted(KVStoreError):
    """A tier cannot make room for a request even after eviction and demotion."""

    code = "CAPACITY_EXHAUSTED"


class BadObject(KVStoreError):
    """Bytes fail their checksum, are truncated, or do not follow the object format."""

    code = "BAD_OBJECT"


class VersionMismatch(KVStoreError):
    """An object, index or peer speaks a format or protocol version this code does not."""

    code = "VERSION_MISMATCH"


class InvalidRequest(KVStoreError):
    """A request is malformed: bad size, unknown tier, empty key, bad argument."""

    code = "INVALID_REQUEST"


class AlreadyExists(KVStoreError):
    """Something that must be new already exists (e.g. a daemon already owns the socket)."""

    code = "ALREADY_EXISTS"


class StorageError(KVStoreError):
    """A tier's medium failed an operation (I/O error, fsync or mmap failure, injected
    fault); the store stays consistent and the request may be retried."""

    code = "STORAGE_ERROR"


class Unauthenticated(KVStoreError):
    """A TCP request carried no token or the wrong one (the daemon's --tcp-token-file)."""

    code = "UNAUTHENTICATED"


ALL_ERRORS: tuple[type[KVStoreError], ...] = (
    KVStoreError,
    DaemonNotRunning,
    UnknownKey,
    CapacityExhausted,
    BadObject,
    VersionMismatch,
    InvalidRequest,
    AlreadyExists,
    StorageError,
    Unauthenticated,
)

ERRORS_BY_CODE: dict[str, type[KVStoreError]] = {cls.code: cls for cls in ALL_ERRORS}


def error_from_code(code: str, message: str) -> KVStoreError:
    """Rebuild an error from its wire `code` and message (unknown codes -> KVStoreError)."""
    return ERRORS_BY_CODE.get(code, KVStoreError)(message)


class IndexDamaged(StorageError):
    """The LMDB index is missing pages, truncated or unreadable (the message says how);
    it is rebuilt from the object files' headers (`kvstore repair --dir DIR`)."""
