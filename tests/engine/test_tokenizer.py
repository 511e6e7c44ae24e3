"""ByteTokenizer: lossless round trip, special ids, streaming decode across split characters."""
from __future__ import annotations

import pytest

from engine.errors import TokenizerError
from engine.tokenizer import ByteTokenizer, load_tokenizer

TEXTS = ["", "hello world", "naïve café — ünïcødé ✓", "日本語のテキスト", "emoji 🧪🚀 mix\n\ttabs", "\x00nul"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True)) == text


def test_special_tokens_are_distinct_and_skipped_unless_asked():
    tok = ByteTokenizer()
    assert tok.vocab_size == 260
    assert len({tok.bos_id, tok.eos_id, tok.pad_id, tok.sep_id}) == 4 and min(tok.special_ids()) == 256
    ids = [tok.bos_id] + tok.encode("ab") + [tok.sep_id] + tok.encode("c") + [tok.eos_id]
    assert tok.decode(ids) == "abc"
    assert tok.decode(ids, skip_special=False) == "<bos>ab<sep>c<eos>"


def test_stream_decoder_holds_back_partial_characters():
    tok = ByteTokenizer()
    text = "a✓b🚀"
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + dec.flush() == text
    assert pieces[1] == "" and pieces[3] == "✓"  # the 3-byte check mark completes on its last byte


def test_invalid_bytes_decode_to_replacement_and_bad_ids_are_named():
    tok = ByteTokenizer()
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"
    with pytest.raises(TokenizerError, match=r"\[260\]"):
        tok.decode([65, 260])
    with pytest.raises(TokenizerError, match="encode takes str"):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="'nope.json'"):
        load_tokenizer("nope.json")
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
