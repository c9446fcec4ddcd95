"""Incremental detokenisation with stop strings: token ids in, stable text out.

Used for streamed and non-streamed responses alike, so a non-streamed response is by
construction the concatenation of the chunks the streamed one would send, and a replay of the
same tokens gives the same pieces (what resuming a stream with Last-Event-ID relies on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    """Token ids in, stable text out, cut at the first stop string.

    Each push decodes the whole output so far and hands out only the new suffix that can no
    longer change: a trailing U+FFFD (an incomplete UTF-8 sequence split across tokens) is held
    back, and so is a suffix that could be the start of a stop string. `finish()` releases what
    was held. Everything handed out is a prefix of the final text.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # handed out so far
        self.stopped = False  # a stop string was found; nothing more will be handed out

    def push(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        return self._advance(self._decode(self.token_ids).rstrip("\ufffd"), final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self._decode(self.token_ids), final=True)

    def _advance(self, full: str, *, final: bool) -> str:
        start = len(self.text)  # a stop string cannot start in text already handed out (it was held back)
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(full[: min(hits)])
        hold = 0
        if not final:
            for k in range(min(self._max_stop - 1, len(full) - start), 0, -1):
                tail = full[-k:]
                if any(s.startswith(tail) for s in self._stop):
                    hold = k
                    break
        return self._release(full[: len(full) - hold])

    def _release(self, upto: str) -> str:
        # Decoding a longer sequence only ever appends to a byte-level BPE's text; if a tokenizer
        # ever rewrote earlier text we cannot take back what was sent, so send only what is new.
        new = upto[len(self.text):] if len(upto) > len(self.text) else ""
        self.text += new
        return new
