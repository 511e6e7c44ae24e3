"""proto/kvstore.proto is the one source of the wire API: the committed generated code in
kvstore/rpc/ must match it, and must load without protoc's runtime-version guard."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvstore.rpc import kvstore_pb2
from kvstore.rpc.service import METHODS

ROOT = Path(__file__).resolve().parents[2]


def _clear_json_names(message) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)


def test_committed_descriptor_matches_a_fresh_compile_of_the_proto():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) compiles the proto")
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                        f"--descriptor_set_out={out}", str(ROOT / "proto" / "kvstore.proto")], check=True)
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc drops json_name from the embedded descriptor
        _clear_json_names(message)
    committed = descriptor_pb2.FileDescriptorProto.FromString(kvstore_pb2.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "kvstore/rpc/ is stale: run python tools/gen_proto.py"


def test_generated_files_are_byte_identical_to_gen_proto_output():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) compiles the proto")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_generated_code_has_no_protobuf_runtime_version_guard():
    text = (ROOT / "kvstore" / "rpc" / "kvstore_pb2.py").read_text()
    assert "runtime_version" not in text
    assert kvstore_pb2.Region.__module__ == "kvstore.rpc.kvstore_pb2"


def test_service_binding_covers_every_rpc_of_the_proto():
    service = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
    assert sorted(METHODS) == sorted(m.name for m in service.methods)
    for m in METHODS.values():
        assert m.path == f"/kvstore.v1.KVStore/{m.name}"
        assert m.request.DESCRIPTOR.full_name.startswith("kvstore.v1.")
