"""Text <-> token ids, and the model's chat template. The engine itself only sees token ids."""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

from transformers import AutoTokenizer


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's table, used by
    Llama 3, Qwen and SmolLM2 tokenizers) -> that byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte tokens


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        eos = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        # Chat models end a turn with their end-of-turn token, which may differ from eos.
        for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.hf.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.hf.unk_token_id and tid >= 0:
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Messages [{"role", "content"}] -> prompt ids ending with the assistant turn's header."""
        if self.hf.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_ids: list[int]) -> list[bytes | None]:
        """The UTF-8 bytes each token adds to `decode`'s text (a token may hold part of a
        character: the text is their concatenation, decoded), None for a special token, which
        `decode` leaves out. Exact for byte-level BPE; for SentencePiece the first token's
        leading space, which decode strips, is kept."""
        table = self._token_bytes
        return [table[t] if 0 <= t < len(table) else None for t in token_ids]

    @cached_property
    def _token_bytes(self) -> list[bytes | None]:
        """Every token's bytes, built once, on the first request that asks for logprobs."""
        decoder = json.loads(self.hf.backend_tokenizer.to_str()).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel"
        alphabet = byte_level_alphabet()
        added = self.hf.added_tokens_decoder  # {id: AddedToken}: stored as written, not byte-level encoded
        pieces = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
        table: list[bytes | None] = []
        for tid, piece in enumerate(pieces):
            if tid in added:
                table.append(None if added[tid].special else added[tid].content.encode())
            elif piece is None:
                table.append(None)
            elif byte_level:
                table.append(bytes(alphabet[c] for c in piece))
            elif m := _BYTE_FALLBACK.match(piece):
                table.append(bytes([int(m.group(1), 16)]))
            else:
                table.append(piece.replace("\u2581", " ").encode())
        return table
