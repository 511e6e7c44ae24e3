"""ObjectIndex (LMDB): durable records, reopen, schema check, map growth, bad records, damage
checks before mapping and rebuilds."""

import os

import lmdb
import pytest

from kvstore.errors import IndexDamaged, VersionMismatch
from kvstore.index import MAX_PAGE, IndexRecord, ObjectIndex, lmdb_needed_bytes


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


def _filled(path, n=2000) -> int:
    idx = ObjectIndex(path)
    idx.open()
    idx.put_many([rec(b"k%05d" % i, file=f"ab/{i}.obj") for i in range(n)])
    idx.close()
    return (path / "data.mdb").stat().st_size


@pytest.mark.parametrize("keep", [0, 100, 4096, 8192 + 7, "half"])
def test_a_truncated_index_is_index_damaged_before_lmdb_maps_it(tmp_path, keep):
    """(In process: a mapping of the truncated file would kill pytest with SIGBUS.)"""
    size = _filled(tmp_path / "i")
    keep = size // 2 if keep == "half" else keep
    os.truncate(tmp_path / "i" / "data.mdb", keep)
    with pytest.raises(IndexDamaged, match="truncated|no valid LMDB meta page"):
        ObjectIndex(tmp_path / "i").open()


def test_a_foreign_file_as_data_mdb_is_index_damaged(tmp_path):
    (tmp_path / "i").mkdir()
    (tmp_path / "i" / "data.mdb").write_bytes(os.urandom(64 << 10))
    with pytest.raises(IndexDamaged, match="no valid LMDB meta page"):
        ObjectIndex(tmp_path / "i").open()


def test_meta_pages_give_the_size_lmdb_needs(tmp_path):
    size = _filled(tmp_path / "i")
    head = (tmp_path / "i" / "data.mdb").read_bytes()[: 2 * MAX_PAGE]
    need = lmdb_needed_bytes(head, size)
    assert need is not None and 2 * 4096 < need <= size
    assert lmdb_needed_bytes(head[:4096], size) is None  # the second meta page is missing


def test_rebuild_moves_the_index_aside_and_fills_a_fresh_one(tmp_path):
    _filled(tmp_path / "i", n=10)
    idx = ObjectIndex(tmp_path / "i", rebuild_source=lambda: [rec(b"only")])
    idx.open()
    assert idx.rebuild("test") == 1
    assert [r.key for r in idx.items()] == [b"only"] and len(idx.moved_aside) == 1
    old = ObjectIndex(idx.moved_aside[0])
    old.open()
    assert len(old) == 10  # moved aside, not deleted
    old.close()
    idx.close()


def test_an_index_shrunk_while_open_is_rebuilt_before_the_next_transaction(tmp_path):
    _filled(tmp_path / "i", n=10)
    idx = ObjectIndex(tmp_path / "i", rebuild_source=lambda: [rec(b"from-files")])
    idx.open()
    os.truncate(tmp_path / "i" / "data.mdb", 4096)  # no page is touched before the check
    idx.put(rec(b"new"))
    assert sorted(r.key for r in idx.items()) == [b"from-files", b"new"] and len(idx.moved_aside) == 1
    idx.close()
