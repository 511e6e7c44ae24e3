"""A load test of the real daemon: 8 client processes, a random mix of operations on one
shared key space that does not fit the tiers (puts keep evicting), bounded in time;
every byte read is checked against its key's content. Zero errors, zero wrong bytes."""

from __future__ import annotations

import os

from kvstore.testing import record_figures
from tools.store_load import run_load, verify_all

PROCESSES = 8
SECONDS = float(os.environ.get("KVSTORE_LOAD_SECONDS", "8"))
KEYS = 400  # ~19 MiB of objects for 4 MiB CPU + 8 MiB NVMe


def test_eight_processes_of_mixed_operations_under_eviction_pressure_lose_and_corrupt_nothing(start_daemon):
    d = start_daemon(cpu_capacity="4MiB", nvme_capacity="8MiB")
    res = run_load(str(d.socket), processes=PROCESSES, seconds=SECONDS, keys=KEYS, seed=18)
    final_ok, final_wrong = verify_all(str(d.socket), KEYS)
    with d.client() as kv:
        stats = kv.stats()
    record_figures("test_load", processes=PROCESSES, seconds=SECONDS, operations=res.operations,
                   objects_verified=res.objects_verified + final_ok, losses=res.wrong_bytes + final_wrong,
                   errors=res.errors, refused=res.refused, evictions=stats["evictions"], demotions=stats["demotions"])
    assert res.errors == 0, res.error_samples
    assert res.wrong_bytes == 0 and final_wrong == 0, res.error_samples
    assert res.operations >= 50 * PROCESSES, res
    assert res.by_op.get("put", 0) > 0 and res.by_op.get("get", 0) > 0 and res.objects_verified > 0, res
    assert stats["evictions"] + stats["demotions"] > 0, "the key space must not fit: puts evict"
    assert final_ok > 0
    assert "Traceback" not in d.log_path.read_text(errors="replace")
