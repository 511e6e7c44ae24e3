"""Two hosts sharing segments through the remote tier: two `kvengine run` PROCESSES, each
attached to its own REAL daemon (separate sockets, directories and arenas), both daemons
on one REAL `mooncake_master` (loopback, TCP). The second engine reuses the segments the
first computed, found only in the remote tier, and its outputs equal the first run's,
which computed every segment itself. Skipped, with the reason, only where Mooncake cannot
be imported or started."""
from __future__ import annotations

import time

import pytest

from kvstore.remote.testing import MooncakeMaster, mooncake_unavailable
from test_cli_store import kvengine_run, segments_only, write_requests

_WHY = mooncake_unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def test_a_second_engine_on_another_daemon_reuses_segments_from_the_remote_tier(start_daemon, tmp_path):
    master = MooncakeMaster(tmp_path / "master")
    try:
        master.start()
    except RuntimeError as exc:
        pytest.skip(f"mooncake_master cannot start here: {exc}")
    try:
        url = master.url.replace("&protocol=tcp", "&protocol=tcp&segment=64MiB")
        args = ["--remote", url, "--cpu-capacity", "64MiB"]
        d1 = start_daemon("host1", extra_args=args)
        d2 = start_daemon("host2", extra_args=args)
        requests = write_requests(tmp_path / "requests.jsonl")
        first = kvengine_run(requests, ["--store", str(d1.socket), "--pic-config", segments_only(tmp_path)], {})
        assert first[0]["reused_tokens"] == 0 and first[0]["store_computed"] == 2
        with d1.client() as kv:
            deadline = time.monotonic() + 30
            while kv.stats()["remote"]["pending_writes"] and time.monotonic() < deadline:
                time.sleep(0.05)
            written = kv.stats()["remote"]["objects_written"]
        assert written >= 3  # the three documents' signatures
        second = kvengine_run(requests, ["--store", str(d2.socket), "--pic-config", segments_only(tmp_path)], {})
        assert all(r["reused_tokens"] > 0 and r["store_computed"] == 0 for r in second)
        assert [r["store_hits_by_tier"]["cpu"] for r in second] == [2, 2]
        assert [r["text"] for r in second] == [r["text"] for r in first]
        with d2.client() as kv:
            remote = kv.stats()["remote"]
        assert remote["hits"] == 3 and remote["corrupt_dropped"] == 0 and remote["errors"] == 0
        d1.cleanup()  # daemons leave the cluster while the master still runs
        d2.cleanup()
    finally:
        master.stop()
