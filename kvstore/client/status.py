"""Translation of gRPC failures into kvstore errors, for both client flavours.

Owns: the rule that a client never raises a raw grpc.RpcError. A daemon-side kvstore
error travels as a gRPC status plus the class code in the trailing metadata
"kvstore-error-code" and comes back as the same class; a daemon that cannot be reached
becomes DaemonNotRunning whose message names the socket and the command to start one.
"""

from __future__ import annotations

from typing import Any, Optional

import grpc

from kvstore import errors
from kvstore.rpc.service import ERROR_CODE_METADATA_KEY

_FALLBACK: dict[grpc.StatusCode, type[errors.KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.NOT_FOUND: errors.UnknownKey,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.InvalidRequest,  # gRPC's own: a message over the size limit
    grpc.StatusCode.DATA_LOSS: errors.BadObject,
    grpc.StatusCode.FAILED_PRECONDITION: errors.VersionMismatch,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.UNIMPLEMENTED: errors.VersionMismatch,
}


def start_hint(target: str) -> str:
    """The command that starts a daemon where a client looked for one."""
    if target.startswith("unix:"):
        from kvstore.config import default_socket

        if target[5:] == str(default_socket()):
            return "kvstore serve"
        return f"kvstore serve --socket {target[5:]}"
    return f"kvstore serve --tcp {target}"


def not_running(target: str, detail: str = "") -> errors.DaemonNotRunning:
    where = target[5:] if target.startswith("unix:") else target
    why = f" ({detail})" if detail else ""
    return errors.DaemonNotRunning(
        f"no kvstore daemon is running at {where}{why}; start one with: {start_hint(target)}"
    )


def _error_code(exc: Any) -> Optional[str]:
    try:
        md = exc.trailing_metadata() or ()
    except Exception:
        return None
    for item in md:
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == ERROR_CODE_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def translate(exc: grpc.RpcError, target: str, rpc: str) -> errors.KVStoreError:
    """The kvstore error for a failed RPC `rpc` to `target` (a grpc.RpcError or aio error)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    kv_code = _error_code(exc)
    if kv_code is not None:
        return errors.error_from_code(kv_code, details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return not_running(target, details.split("\n")[0][:200])
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.KVStoreError(f"the kvstore daemon at {target} did not answer {rpc} in time")
    if code == grpc.StatusCode.CANCELLED:
        return errors.KVStoreError(f"{rpc} to the kvstore daemon at {target} was cancelled")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return errors.VersionMismatch(f"the daemon at {target} does not implement {rpc}; it runs another "
                                      "kvstore version")
    cls = _FALLBACK.get(code, errors.KVStoreError)
    return cls(f"{rpc} failed: {details or code.name}")
