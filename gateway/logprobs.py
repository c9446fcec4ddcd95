"""Token log-probabilities -> OpenAI's `logprobs` objects, aligned with the text handed out.

The numbers are the target's (dspark/sampling/logprobs.py: log_softmax of its logits before
temperature, top-k and top-p). Here they meet the text. Each token's place in the completion
text is `text_offset`: the characters of the text before it (a token that holds only part of a
character begins at that character). `TokenAligner` hands a token's entry out with the text
that holds its first character, so every chunk carries the entries of its own text and a
non-streamed response has the concatenation of the streamed chunks' entries. At the end of a
generation the tokens with no text of their own (the stop token) follow. A stop string cuts the
entries with the text: a token that begins at or after the cut is not reported.

How a token is shown: `token` is its text, or for a token that is not whole UTF-8 characters
OpenAI's "bytes:\\xe2\\x80" form; `bytes` its UTF-8 bytes; a special token (which the text leaves
out, e.g. <|im_end|>) shows its name with `bytes: null`. A log-probability of -inf (a token the
model rules out, listed only when fewer tokens than asked are possible) is sent as -9999.0, as
OpenAI does: JSON has no infinity.
"""

from __future__ import annotations

import codecs
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from dspark.sampling.logprobs import TokenLogprobs
from gateway.openai_schema import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

__all__ = ["Detokenizer", "TokenAligner", "TokenEntry", "chat_logprobs", "completion_logprobs"]

IMPOSSIBLE_LOGPROB = -9999.0  # what -inf is sent as (OpenAI's value)


class Detokenizer(Protocol):
    """What turning token ids into text needs of a tokenizer (dspark.model.tokenizer.Tokenizer has it)."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_ids: list[int]) -> list[bytes | None]:
        """The UTF-8 bytes each token adds to decode()'s text; None for a special token it leaves out."""
        ...


@dataclass(frozen=True)
class TokenEntry:
    """One emitted token with its log-probability and alternatives, placed in the text."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [k] (token id, logprob), most likely first
    text_offset: int  # characters of the completion text before this token


class TokenAligner:
    """Token entries in, the entries whose text has been handed out, out (module docstring)."""

    def __init__(self, tokenizer: Detokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as decode() reads the bytes
        self._chars = 0  # whole characters of the text so far
        self._pending: deque[TokenEntry] = deque()  # offsets ascending

    def push(self, token_ids: list[int], logprobs: TokenLogprobs | None) -> None:
        if logprobs is None:
            if token_ids:
                raise ValueError(f"{len(token_ids)} tokens arrived without the logprobs the request asked for")
            return
        for tid, piece, lp, ids, lps in zip(token_ids, self._tokenizer.token_bytes(token_ids), logprobs.logprobs,
                                            logprobs.top_ids, logprobs.top_logprobs):
            self._pending.append(TokenEntry(tid, lp, list(zip(ids, lps)), self._chars))
            if piece:
                self._chars += len(self._utf8.decode(piece))

    def release(self, text_length: int, *, end: bool = False) -> list[TokenEntry]:
        """Entries of the tokens that begin within the first `text_length` characters handed out;
        with `end` (the generation is over and no stop string cut it) every remaining one."""
        out = []
        while self._pending and (end or self._pending[0].text_offset < text_length):
            e = self._pending.popleft()
            out.append(e if e.text_offset <= text_length else TokenEntry(e.token_id, e.logprob, e.top, text_length))
        return out


def _shown(tokenizer: Detokenizer, token_ids: list[int]) -> list[tuple[str, list[int] | None]]:
    """(token, bytes) as OpenAI shows each token (module docstring)."""
    out = []
    for tid, piece in zip(token_ids, tokenizer.token_bytes(token_ids)):
        if piece is None:
            out.append((tokenizer.decode([tid], skip_special_tokens=False), None))
            continue
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
        out.append((text, list(piece)))
    return out


def _finite(logprob: float) -> float:
    return IMPOSSIBLE_LOGPROB if math.isinf(logprob) else logprob


def chat_logprobs(entries: list[TokenEntry], tokenizer: Detokenizer) -> ChatChoiceLogprobs:
    """choices[].logprobs of a chat completion (or of one chunk): one content item per token."""
    content = []
    for e in entries:
        shown = _shown(tokenizer, [e.token_id, *(tid for tid, _ in e.top)])
        (token, raw), alternatives = shown[0], shown[1:]
        content.append(ChatTokenLogprob(
            token=token, logprob=_finite(e.logprob), bytes=raw,
            top_logprobs=[TopLogprob(token=t, logprob=_finite(lp), bytes=b) for (t, b), (_, lp) in zip(alternatives, e.top)],
        ))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(entries: list[TokenEntry], tokenizer: Detokenizer) -> CompletionLogprobs:
    """choices[].logprobs of a completion (or of one chunk): parallel lists, one entry per token;
    each top_logprobs dict holds the k alternatives and the emitted token (up to k + 1, as OpenAI)."""
    tokens, top = [], []
    for e in entries:
        shown = [t for t, _ in _shown(tokenizer, [e.token_id, *(tid for tid, _ in e.top)])]
        alternatives = {t: _finite(lp) for t, (_, lp) in zip(shown[1:], e.top)}
        alternatives.setdefault(shown[0], _finite(e.logprob))
        tokens.append(shown[0])
        top.append(alternatives)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[_finite(e.logprob) for e in entries], top_logprobs=top,
                              text_offset=[e.text_offset for e in entries])
