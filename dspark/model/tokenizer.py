"""Text <-> token ids, and the model's chat template. The engine itself only sees token ids."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer


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
