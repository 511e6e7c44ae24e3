"""Incremental detokenization and stop strings for one request's output.

Token ids arrive one step at a time; `OutputText.append` turns them into text through
the tokenizer's stream decoder (engine.tokenizer.Tokenizer.stream_decoder), which never
emits half of a multi-byte character, and finds stop strings that span token
boundaries. Text that could still turn out to be the start of a stop string is held
back from `take_delta` until it is resolved, so a stream never shows a stop string that
the final text does not contain. Ids beyond the tokenizer's vocabulary (a benchmark
model with a larger vocabulary than the byte tokenizer) and special ids add no text.
"""
from __future__ import annotations

from typing import Sequence

from engine.tokenizer import Tokenizer


class OutputText:
    """The text of one request's output, built token by token."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._decoder = tokenizer.stream_decoder()
        self._vocab = tokenizer.vocab_size
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""  # everything decoded so far (cut at a stop string once one is hit)
        self._emitted = 0  # chars of `text` handed out by take_delta
        self.stopped_on: str | None = None

    def append(self, token_ids: Sequence[int]) -> bool:
        """Add output tokens; returns True when a stop string was found (the text is then
        cut just before it and further tokens are ignored)."""
        if self.stopped_on is not None:
            return True
        for tid in token_ids:
            if not 0 <= tid < self._vocab:
                continue
            new = self._decoder.push(int(tid))
            if not new:
                continue
            start = max(0, len(self.text) - self._max_stop + 1)
            self.text += new
            if self._stop and self._find_stop(start):
                return True
        return False

    def _find_stop(self, search_from: int) -> bool:
        best = -1
        for s in self._stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best == -1 or idx < best):
                best, self.stopped_on = idx, s
        if best == -1:
            return False
        self.text = self.text[:best]
        return True

    def take_delta(self, final: bool = False) -> str:
        """Text not handed out before. Unless `final`, keeps back a tail that could be
        the beginning of a stop string."""
        end = len(self.text)
        if not final and self.stopped_on is None and self._max_stop > 1:
            end = max(self._emitted, end - self._held_back())
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def flush(self) -> str:
        """At the end: whatever text remains, including a dangling partial character
        (decoded as U+FFFD)."""
        if self.stopped_on is None:
            start = max(0, len(self.text) - self._max_stop + 1)
            self.text += self._decoder.flush()
            if self._stop:
                self._find_stop(start)
        return self.take_delta(final=True)
