"""The gRPC baseline of tools/bench_store.py: the same bytes shipped inside gRPC messages to
a sink process over a unix socket (Put: bytes in; Get: `chunk` bytes out), to show what
the shared-memory data plane saves.

    python -m tools.storebench.grpc_baseline SOCKET CHUNK   # the sink (started by grpc_gbps)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SINK_SERVICE = "bench.Sink"


def _seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_sink(sock: str, chunk: int) -> None:
    """`--grpc-sink`: a process answering Put (bytes in) and Get (chunk bytes out)."""
    import grpc

    payload = os.urandom(chunk)
    handlers = {
        "Put": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b""),
        "Get": grpc.unary_unary_rpc_method_handler(lambda req, ctx: payload),
    }
    opts = [("grpc.max_send_message_length", chunk + 1024), ("grpc.max_receive_message_length", chunk + 1024)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SINK_SERVICE, handlers),))
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    server.wait_for_termination()


def grpc_gbps(data: np.ndarray, count: int, chunk: int, tmp: Path) -> tuple[float, float]:
    import grpc

    sock = str(tmp / "sink.sock")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "tools.storebench.grpc_baseline", sock, str(chunk)], env=env,
                            cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("gRPC sink did not start")
            time.sleep(0.05)
        opts = [("grpc.max_send_message_length", chunk + 1024), ("grpc.max_receive_message_length", chunk + 1024)]
        with grpc.insecure_channel(f"unix:{sock}", options=opts) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            put = ch.unary_unary(f"/{SINK_SERVICE}/Put")
            get = ch.unary_unary(f"/{SINK_SERVICE}/Get")
            size = data.nbytes
            mv = memoryview(data)

            def put_all() -> None:
                for _ in range(count):
                    for off in range(0, size, chunk):
                        put(bytes(mv[off: off + chunk]))  # a message owns its bytes: one copy in

            out = np.empty(size, dtype=np.uint8)

            def get_all() -> None:
                for _ in range(count):
                    for off in range(0, size, chunk):
                        got = get(b"")
                        n = min(len(got), size - off)
                        out[off: off + n] = np.frombuffer(got, dtype=np.uint8, count=n)

            put(b"")
            p = _seconds(put_all)
            g = _seconds(get_all)
        return size * count / p / 1e9, size * count / g / 1e9
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    run_sink(sys.argv[1], int(sys.argv[2]))
