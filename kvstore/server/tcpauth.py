"""The TCP listener's guard: every call must carry the daemon's bearer token.

Owns: `TokenCheck`, a grpc.aio server interceptor that lets a call through only when its
metadata holds `authorization: Bearer <token>` (constant-time compare, see
kvstore.rpc.auth) and otherwise answers UNAUTHENTICATED (error code UNAUTHENTICATED in
the trailing metadata) without running the handler or parsing the request, counting
each refusal; and `tcp_settings`, which checks a config's TCP options (a token is
required, TLS takes a certificate and its key together) before anything listens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import grpc

from kvstore.config import Config, ConfigError
from kvstore.errors import InvalidRequest, Unauthenticated
from kvstore.rpc.auth import TlsFiles, read_pem, read_token_file, token_matches
from kvstore.rpc.service import ERROR_CODE_METADATA_KEY

log = logging.getLogger("kvstore.server")


@dataclass(frozen=True)
class TcpSettings:
    """What the TCP listener needs: where to bind, the token, and TLS files (or None)."""

    host: str
    port: int
    token: str
    tls: Optional[TlsFiles]

    @property
    def target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def tcp_settings(cfg: Config) -> Optional[TcpSettings]:
    """The TCP listener of `cfg`, or None without --tcp. ConfigError (one line) when --tcp
    has no token file, the token file is unusable, or TLS is half configured."""
    address = cfg.tcp_address()
    if address is None:
        return None
    if not cfg.tcp_token_file:
        raise ConfigError(f"--tcp {cfg.tcp} needs a token: pass --tcp-token-file FILE (or set "
                          "KVSTORE_TCP_TOKEN_FILE, or tcp_token_file in the config file); TCP clients send it "
                          "with every request")
    try:
        token = read_token_file(cfg.tcp_token_file)
        tls = None
        if cfg.tcp_tls_cert or cfg.tcp_tls_key:
            if not (cfg.tcp_tls_cert and cfg.tcp_tls_key):
                raise InvalidRequest("TLS needs both --tcp-tls-cert and --tcp-tls-key")
            tls = TlsFiles(cert=read_pem(cfg.tcp_tls_cert, "tcp_tls_cert"), key=read_pem(cfg.tcp_tls_key, "tcp_tls_key"))
    except InvalidRequest as exc:
        raise ConfigError(str(exc)) from None
    return TcpSettings(address[0], address[1], token, tls)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    assert tls.cert is not None and tls.key is not None
    return grpc.ssl_server_credentials([(tls.key, tls.cert)])


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the right bearer token; `on_refused(method)` counts it."""

    def __init__(self, token: str, on_refused: Callable[[str], None]) -> None:
        self._token = token
        self._on_refused = on_refused

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            context.set_trailing_metadata(((ERROR_CODE_METADATA_KEY, Unauthenticated.code),))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "the kvstore daemon refused the request: no valid token (pass --tcp-token-file "
                                "FILE holding the daemon's token)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)  # raw bytes: nothing is parsed

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        if token_matches(self._token, handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        self._on_refused(handler_call_details.method)
        log.debug("TCP request %s refused: no valid token", handler_call_details.method)
        return self._deny
