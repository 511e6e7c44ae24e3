"""kvstore.objheader: the header record at the end of NVMe object files."""

import os

import pytest

from kvstore.errors import BadObject
from kvstore.objheader import MAGIC_DEAD, TAIL, ObjectHeader, decode_trailer, mark_dead, read_trailer

H = ObjectHeader(b"key\x00\xff", 5000, 2**64 - 1, "model-a", 12, 0.25, {"seg": [1, 2]}, 1234.5)


def test_a_header_round_trips_through_a_file(tmp_path):
    path = tmp_path / "o.obj"
    path.write_bytes(b"x" * 5000 + H.encode_trailer())
    t = read_trailer(str(path))
    assert t is not None and t.live and t.header == H and t.nbytes == len(H.encode_trailer())


def test_a_file_without_a_trailer_is_the_old_layout():
    assert decode_trailer(b"x" * 5000) is None
    assert decode_trailer(b"") is None


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[:3] + bytes([b[3] ^ 1]) + b[4:], "crc32"),  # a flipped body byte
    (lambda b: b[: -TAIL.size] + (10**6).to_bytes(4, "little") + b[-12:], "record"),  # a length past the data
])
def test_damaged_trailers_are_bad_object_naming_the_damage(damage, words):
    with pytest.raises(BadObject, match=words):
        decode_trailer(damage(H.encode_trailer()))


def test_a_size_that_does_not_add_up_is_bad_object(tmp_path):
    path = tmp_path / "o.obj"
    path.write_bytes(b"x" * 4000 + H.encode_trailer())  # the header says 5000 bytes
    with pytest.raises(BadObject, match="the file has"):
        read_trailer(str(path))


def test_mark_dead_flips_only_a_live_trailer_and_keeps_the_bytes(tmp_path):
    path = tmp_path / "o.obj"
    path.write_bytes(b"x" * 5000 + H.encode_trailer())
    assert mark_dead(str(path)) and not mark_dead(str(path))
    t = read_trailer(str(path))
    assert t is not None and not t.live and path.read_bytes()[:5000] == b"x" * 5000
    assert path.read_bytes().endswith(MAGIC_DEAD)


def test_symlinks_are_not_followed(tmp_path):
    (tmp_path / "real").write_bytes(b"x" * 5000 + H.encode_trailer())
    os.symlink(tmp_path / "real", tmp_path / "link.obj")
    with pytest.raises(OSError):
        read_trailer(str(tmp_path / "link.obj"))
