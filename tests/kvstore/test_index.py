"""ObjectIndex (LMDB): durable records, reopen, schema check, map growth, bad records."""

import lmdb
import pytest

from kvstore.errors import VersionMismatch
from kvstore.index import IndexRecord, ObjectIndex


def rec(key: bytes, **kw) -> IndexRecord:
    base = dict(tier="nvme", file="ab/ab.obj", offset=0, length=4096, size=100, checksum=2**64 - 1,
                fingerprint="m", token_count=7, cost=0.5, extra={"seg": [1, 2]}, created=1.0, last_access=2.0, hits=3)
    base.update(kw)
    return IndexRecord(key=key, **base)


def test_records_survive_reopen_exactly(tmp_path):
    idx = ObjectIndex(tmp_path / "index.lmdb")
    idx.open()
    idx.put(rec(b"a"))
    idx.put_many([rec(b"b", size=5), rec(b"c")])
    idx.delete(b"c")
    idx.close()
    idx = ObjectIndex(tmp_path / "index.lmdb")
    idx.open()
    assert idx.get(b"a") == rec(b"a") and idx.get(b"c") is None
    assert [r.key for r in idx.items()] == [b"a", b"b"] and len(idx) == 2
    idx.close()


def test_other_schema_version_is_version_mismatch(tmp_path):
    idx = ObjectIndex(tmp_path / "i")
    idx.open()
    idx.close()
    env = lmdb.open(str(tmp_path / "i"), max_dbs=4)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"schema_version", b"99")
    env.close()
    with pytest.raises(VersionMismatch, match="schema version 99"):
        ObjectIndex(tmp_path / "i").open()


def test_map_grows_when_full(tmp_path):
    idx = ObjectIndex(tmp_path / "i", map_size=64 * 1024)
    idx.open()
    idx.put_many([rec(f"k{i}".encode(), extra={"pad": "x" * 500}) for i in range(400)])
    assert len(idx) == 400
    idx.close()


def test_undecodable_record_is_skipped_and_reported(tmp_path):
    idx = ObjectIndex(tmp_path / "i")
    idx.open()
    idx.put(rec(b"good"))
    idx._write(lambda txn: txn.put(b"junk", b"\xc1\xc1"))
    assert [r.key for r in idx.items()] == [b"good"] and idx.bad_keys == [b"junk"]
    idx.close()
