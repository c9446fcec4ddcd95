"""The tokenizer's token bytes (what logprobs show as `bytes`), on the default model's byte-level BPE.

Specification: every token's bytes, concatenated and decoded as UTF-8, are exactly `decode`'s
text (characters split across tokens included); a special token, which `decode` leaves out, has
none; the GPT-2 byte alphabet maps 256 characters to the 256 bytes.
"""

from __future__ import annotations

import pytest

from dspark.model.tokenizer import byte_level_alphabet

TEXTS = [
    "Hello, world!",
    "  def f(x):\n\treturn x ** 2  \n\n",
    "über → naïve café, 你好 🎉 emoji 👩‍👩‍👧 and ∑ᵢ xᵢ²",
    "\x00\x7f\u00a0 nbsp and tabs\t\t",
]


def test_the_byte_alphabet_is_a_bijection_onto_the_bytes():
    alphabet = byte_level_alphabet()
    assert len(alphabet) == 256 and sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["Ġ"] == ord(" ")  # the printable stand-in of a space


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_the_decoded_text(real_tokenizer, text):
    ids = real_tokenizer.encode(text)
    pieces = real_tokenizer.token_bytes(ids)
    assert all(p is not None for p in pieces)
    assert b"".join(pieces).decode("utf-8", errors="replace") == real_tokenizer.decode(ids) == text


@pytest.mark.slow
def test_special_tokens_have_no_bytes_and_chat_turns_spell_their_text(real_tokenizer):
    ids = real_tokenizer.encode_chat([{"role": "user", "content": "über 🎉"}])
    pieces = real_tokenizer.token_bytes(ids)
    specials = [t for t, p in zip(ids, pieces) if p is None]
    assert specials and set(specials) <= {real_tokenizer.hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert b"".join(p for p in pieces if p is not None).decode("utf-8") == real_tokenizer.decode(ids)
    assert real_tokenizer.token_bytes(sorted(real_tokenizer.eos_token_ids)) == [None] * len(real_tokenizer.eos_token_ids)
