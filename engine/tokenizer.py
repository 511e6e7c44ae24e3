"""Tokenizers: the `Tokenizer` interface the engine uses, and `ByteTokenizer`, the byte-level
tokenizer of the models trained here.

ByteTokenizer ids: 0..255 are the UTF-8 bytes; then four special tokens
`BOS=256, EOS=257, PAD=258, SEP=259` (SEP marks a segment boundary where a caller wants one).
Decoding skips special tokens by default and replaces invalid UTF-8 with U+FFFD.

A real tokenizer plugs in by implementing `Tokenizer` (encode/decode/special ids/vocab
size); `load_tokenizer("byte")` or `load_tokenizer("<path>/tokenizer.json")` (the latter
needs the optional `tokenizers` package; nothing is ever downloaded). A Hugging Face
checkpoint directory's own tokenizer (special tokens, chat template, stop tokens) is
`engine.models.hf.tokenizer.CheckpointTokenizer`.
"""
from __future__ import annotations

import abc
import codecs
from pathlib import Path
from typing import Iterable

from engine.errors import TokenizerError


class Tokenizer(abc.ABC):
    """Text <-> token ids. Implementations are immutable and thread-safe."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def pad_id(self) -> int | None: ...

    @property
    def sep_id(self) -> int | None:
        """Segment separator id, or None when the tokenizer has none."""
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation (unless a request ignores EOS): the EOS by default; a
        checkpoint's tokenizer gives its generation_config's list."""
        return () if self.eos_id is None else (self.eos_id,)

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def special_ids(self) -> set[int]:
        return {i for i in (self.bos_id, self.eos_id, self.pad_id, self.sep_id) if i is not None}

    def stream_decoder(self) -> "StreamDecoder":
        """A decoder that turns ids arriving one by one into text pieces."""
        return _DiffStreamDecoder(self)


class StreamDecoder(abc.ABC):
    @abc.abstractmethod
    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes (may be '' mid-character)."""

    @abc.abstractmethod
    def flush(self) -> str:
        """Text still held back at the end of the stream."""


class _DiffStreamDecoder(StreamDecoder):
    """Generic fallback: decode everything so far and emit the new suffix (held back while
    the text ends in a replacement character, which may be an incomplete character)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok, self._ids, self._emitted = tok, [], 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        out, self._emitted = text[self._emitted:], len(text)
        return out

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        out, self._emitted = text[self._emitted:], len(text)
        return out


class ByteTokenizer(Tokenizer):
    BOS, EOS, PAD, SEP = 256, 257, 258, 259
    SPECIAL_NAMES = {256: "<bos>", 257: "<eos>", 258: "<pad>", 259: "<sep>"}

    @property
    def vocab_size(self) -> int:
        return 260

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def sep_id(self) -> int:
        return self.SEP

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_bos else ids

    def _check(self, ids: Iterable[int]) -> list[int]:
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} outside the byte vocabulary [0, {self.vocab_size})")
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in self._check(ids):
            if i < 256:
                buf.append(i)
                continue
            if not skip_special:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                parts.append(self.SPECIAL_NAMES[i])
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()


class _ByteStreamDecoder(StreamDecoder):
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 260:
            raise TokenizerError(f"token id {token_id} outside the byte vocabulary [0, 260)")
        if token_id >= 256:
            return ""
        return self._dec.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizerFile(Tokenizer):
    """A `tokenizers` tokenizer.json read from disk (optional dependency; no downloads)."""

    def __init__(self, path: str | Path, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:
            raise TokenizerError(f"reading {path} needs the optional 'tokenizers' package") from e
        self._tok = _HF.from_file(str(path))
        self._bos = self._tok.token_to_id(bos) if bos else None
        self._eos = self._tok.token_to_id(eos) if eos else None
        self._pad = self._tok.token_to_id(pad) if pad else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self._bos] if add_bos and self._bos is not None else []) + ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


def load_tokenizer(spec: str = "byte") -> Tokenizer:
    """'byte' -> ByteTokenizer; a path to a tokenizer.json -> HFTokenizerFile."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_file():
        return HFTokenizerFile(path)
    raise TokenizerError(f"tokenizer spec {spec!r} is neither 'byte' nor an existing tokenizer.json")
