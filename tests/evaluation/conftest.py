"""Fixtures for the offline evaluation: a byte-level chat tokenizer for the tiny random target,
a tiny random DSpark checkpoint on disk, and a whole tiny HF model directory for the CLI.

The tiny target (tests/conftest.py) has a 256-token vocabulary, so `ByteChatTokenizer` maps
text to its UTF-8 bytes; it cuts every message to `max_chars` so that benchmark prompts fit the
tiny model's context, and logs every conversation it encodes (what the multi-turn test reads).
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.dspark.checkpoint import save_checkpoint
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.model.transformer import Transformer
from tests.conftest import random_hf_state_dict

TINY_CAPTURE_LAYERS = (1, 3)  # what the tiny DSpark checkpoint reads of the 4-layer tiny target


class ByteChatTokenizer:
    def __init__(self, *, max_chars: int = 40, eos_token_ids: frozenset[int] = frozenset()):
        self.max_chars = max_chars
        self.eos_token_ids = eos_token_ids
        self.conversations: list[list[dict[str, str]]] = []  # every encode_chat input, in order

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        self.conversations.append([dict(m) for m in messages])
        text = "".join(f"<{m['role']}>{m['content'][: self.max_chars]}\n" for m in messages) + "<assistant>"
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("latin-1")


@pytest.fixture
def byte_tokenizer() -> ByteChatTokenizer:
    return ByteChatTokenizer()


def save_tiny_dspark_checkpoint(target: Transformer, path, *, block_size: int = 4, seed: int = 0):
    """A random 1-layer DSpark drafter for `target` whose Markov head moves the distribution."""
    torch.manual_seed(seed)
    config = DSparkConfig.from_target(target.config, block_size=block_size, markov_rank=8, num_layers=1,
                                      target_layer_ids=TINY_CAPTURE_LAYERS)
    model = DSparkDrafter(config, shared=SharedWeights.from_target(target))
    with torch.no_grad():  # the head starts at zero; give it something to do
        model.head.w2.normal_(0.0, 0.5)
    save_checkpoint(path, drafter=model)
    return path


@pytest.fixture
def tiny_dspark_checkpoint(tiny_runtime_factory, tmp_path):
    """(runtime capturing the drafter's layers, checkpoint dir) of a tiny random DSpark drafter, block 4."""
    runtime = tiny_runtime_factory(capture_layers=TINY_CAPTURE_LAYERS)
    return runtime, save_tiny_dspark_checkpoint(runtime.model, tmp_path / "dspark-ckpt")


def write_byte_tokenizer(directory) -> int:
    """A byte-level BPE tokenizer without merges (256 byte tokens + ChatML specials) with a
    ChatML chat template, saved as HF tokenizer files. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", chat_template=template)
    fast.save_pretrained(str(directory))
    return len(fast)


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A complete HF model directory (config.json, model.safetensors, tokenizer) of a tiny random
    Llama with a byte-level tokenizer: what `--model DIR` loads in CLI tests, in milliseconds."""
    from safetensors.torch import save_file

    directory = tmp_path / "tiny-model"
    directory.mkdir()
    vocab_size = write_byte_tokenizer(directory)
    config = ModelConfig.tiny(vocab_size=vocab_size, max_position_embeddings=2048)
    sd = random_hf_state_dict(config, seed=0)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": True,
    }))
    return directory


@pytest.fixture
def tiny_model_dspark_checkpoint(tiny_model_dir, tmp_path):
    """A tiny random DSpark checkpoint (block 4) for the model in `tiny_model_dir`."""
    return save_tiny_dspark_checkpoint(Transformer.from_dir(tiny_model_dir), tmp_path / "tiny-model-dspark")
