"""The gRPC binding of the `kvstore.v1.KVStore` service, built from the proto descriptor.

Owns: the method table (name -> request/response classes), the client stub, the server's
generic handler, the protocol version, the health-check wire encoding and the metadata
keys the two ends agree on. Building these from `kvstore_pb2.DESCRIPTOR` at import time
(rather than committing protoc's `_pb2_grpc.py`) keeps the binding in step with the proto
and free of grpcio-version guards, so it runs on older grpcio wheels too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import grpc

from kvstore.rpc import kvstore_pb2 as pb

SERVICE_NAME = "kvstore.v1.KVStore"
# Bump on any incompatible change to proto/kvstore.proto or to the region semantics.
PROTOCOL_VERSION = 1

# Metadata keys (lower case, as gRPC requires).
PROTOCOL_METADATA_KEY = "kvstore-protocol"
ERROR_CODE_METADATA_KEY = "kvstore-error-code"

# Standard gRPC health checking (grpc.health.v1), spoken on the wire directly so clients
# need no grpcio-health-checking wheel: HealthCheckRequest{string service = 1} and
# HealthCheckResponse{ServingStatus status = 1} with SERVING = 1.
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_SERVING = 1


def encode_health_request(service: str = "") -> bytes:
    """Serialize a grpc.health.v1.HealthCheckRequest."""
    raw = service.encode()
    if not raw:
        return b""
    if len(raw) > 127:
        raise ValueError(f"health service name too long: {service!r}")
    return b"\x0a" + bytes([len(raw)]) + raw


def decode_health_status(raw: bytes) -> int:
    """Parse a grpc.health.v1.HealthCheckResponse into its status number (0: UNKNOWN)."""
    if len(raw) >= 2 and raw[0] == 0x08:
        return raw[1]
    return 0


def channel_options(max_message_size: int) -> list[tuple[str, Any]]:
    """gRPC options both ends use: message-size limits, and no HTTP proxy on local links."""
    return [
        ("grpc.max_send_message_length", max_message_size),
        ("grpc.max_receive_message_length", max_message_size),
        ("grpc.enable_http_proxy", 0),
    ]


def client_channel_options(max_message_size: int, target: str) -> list[tuple[str, Any]]:
    """`channel_options` plus what a client channel to the daemon wants: no transparent
    retries (every kvstore RPC reports its own failure; the retry filter buffers each
    call for nothing), and for a unix socket no DNS/authority work: a local authority."""
    opts = channel_options(max_message_size) + [("grpc.enable_retries", 0)]
    if target.startswith("unix:"):
        opts.append(("grpc.default_authority", "localhost"))
    return opts


@dataclass(frozen=True)
class Method:
    """One RPC of the service."""

    name: str
    request: type
    response: type

    @property
    def path(self) -> str:
        return f"/{SERVICE_NAME}/{self.name}"


def _methods() -> dict[str, Method]:
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    table = {}
    for m in service.methods:
        table[m.name] = Method(
            name=m.name,
            request=getattr(pb, m.input_type.name),
            response=getattr(pb, m.output_type.name),
        )
    return table


METHODS: dict[str, Method] = _methods()


class KVStoreStub:
    """Client stub: one attribute per RPC (`stub.Lookup(request, timeout=...)`)."""

    def __init__(self, channel: grpc.Channel | Any) -> None:
        for method in METHODS.values():
            setattr(
                self,
                method.name,
                channel.unary_unary(
                    method.path,
                    request_serializer=method.request.SerializeToString,
                    response_deserializer=method.response.FromString,
                ),
            )


@dataclass(frozen=True)
class MalformedRequest:
    """What the server's deserializer hands the servicer instead of a message it could
    not accept (bytes that do not parse, or fields this protocol version does not know);
    the servicer answers INVALID_ARGUMENT with `reason`."""

    method: str
    reason: str


def unknown_field_numbers(msg: Any) -> list[int]:
    """Field numbers present on the wire but not in the schema, in `msg` and nested messages."""
    found: list[int] = []
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet

        found += [f.field_number for f in UnknownFieldSet(msg)]
    except ImportError:  # protobuf < 4.24: the older accessor
        found += [f.field_number for f in msg.UnknownFields()]
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == 3  # LABEL_REPEATED
        for sub in value if repeated else (value,):
            found += unknown_field_numbers(sub)
    return sorted(set(found))


def _request_parser(method: Method) -> Callable[[bytes], Any]:
    full_name = method.request.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Any:
        try:
            msg = method.request.FromString(raw)
        except Exception as exc:
            return MalformedRequest(method.name, f"{method.name}: the request is not a valid {full_name}: {exc}")
        unknown = unknown_field_numbers(msg)
        if unknown:
            return MalformedRequest(
                method.name,
                f"{method.name}: {full_name} carries unknown field number(s) {unknown}; this daemon speaks "
                f"kvstore protocol {PROTOCOL_VERSION} (is the client newer than the daemon?)",
            )
        return msg

    return parse


def generic_handler(implementations: dict[str, Callable]) -> grpc.GenericRpcHandler:
    """A server handler routing each RPC name to `implementations[name](request, context)`.

    Every method of the service must be implemented; a missing one is a programming error.
    A request that does not parse, or carries unknown fields, reaches the implementation
    as a `MalformedRequest`.
    """
    missing = sorted(set(METHODS) - set(implementations))
    if missing:
        raise ValueError(f"no implementation for RPC(s): {', '.join(missing)}")
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            implementations[name],
            request_deserializer=_request_parser(method),
            response_serializer=method.response.SerializeToString,
        )
        for name, method in METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
