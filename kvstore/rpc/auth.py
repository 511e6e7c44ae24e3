"""Token authentication of TCP clients: what the daemon and its clients agree on.

Owns: the bearer-token file format (one line of text, at least `MIN_TOKEN_CHARS`
printable characters, not readable by other users), the call metadata that carries the
token (`authorization: Bearer <token>`), and the TLS credential files. The daemon checks
the token in a server interceptor on its TCP listener (kvstore.server.tcpauth); the
unix socket needs none (its mode, 0600, is the check).
"""

from __future__ import annotations

import hmac
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from kvstore.errors import InvalidRequest

AUTH_METADATA_KEY = "authorization"
BEARER = "Bearer "
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096


def read_token_file(path: Union[str, Path], what: str = "tcp_token_file") -> str:
    """The token in `path`; InvalidRequest (one line, naming the file) when it is missing,
    unreadable, empty, too short, holds non-printable characters or is open to other
    users (mode o+rwx)."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
        raw = p.read_bytes()
    except FileNotFoundError:
        raise InvalidRequest(f"{what}: token file {p} does not exist") from None
    except OSError as exc:
        raise InvalidRequest(f"{what}: cannot read token file {p}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest(f"{what}: {p} is not a regular file")
    if stat.S_IMODE(st.st_mode) & 0o007:
        raise InvalidRequest(f"{what}: token file {p} is accessible to other users (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise InvalidRequest(f"{what}: token file {p} is not ASCII text") from None
    if len(token) < MIN_TOKEN_CHARS or len(token) > MAX_TOKEN_CHARS:
        raise InvalidRequest(f"{what}: the token in {p} is {len(token)} characters; it must hold "
                             f"{MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} (e.g. `openssl rand -hex 32 > {p}`)")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise InvalidRequest(f"{what}: the token in {p} holds whitespace or control characters")
    return token


def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata pair a client sends with every call."""
    return (AUTH_METADATA_KEY, BEARER + token)


def token_matches(expected: str, metadata: Optional[tuple]) -> bool:
    """True when `metadata` (gRPC invocation metadata) carries `Bearer <expected>`;
    constant-time in the token's bytes."""
    want = (BEARER + expected).encode()
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == AUTH_METADATA_KEY:
            got = value if isinstance(value, bytes) else str(value).encode()
            return hmac.compare_digest(got, want)
    return False


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS endpoint: the daemon's certificate chain and key, or a client's
    trusted CA bundle (`ca`)."""

    cert: Optional[bytes] = None
    key: Optional[bytes] = None
    ca: Optional[bytes] = None


def read_pem(path: Union[str, Path], what: str) -> bytes:
    """The bytes of a PEM file; InvalidRequest naming the option and the file otherwise."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise InvalidRequest(f"{what}: {p} does not exist") from None
    except OSError as exc:
        raise InvalidRequest(f"{what}: cannot read {p}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise InvalidRequest(f"{what}: {p} is not a PEM file")
    return data

