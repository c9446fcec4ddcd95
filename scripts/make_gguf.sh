#!/usr/bin/env bash
# A bf16 GGUF of the default model (or MODEL_DIR) for the llama.cpp peer of
# benchmarks/bench_peers.py, converted with llama.cpp's own convert_hf_to_gguf.py as shipped in
# the sdist of the installed llama-cpp-python (so converter and runtime are the same version).
#   .venv/bin/pip install llama-cpp-python   # builds llama.cpp from source: ~12 min on 2 cores
#   (this script also installs sentencepiece, which the converter imports)
#   bash scripts/make_gguf.sh [MODEL_DIR] [OUT]
# OUT defaults to ~/.cache/dspark/gguf/<model dir name>-bf16.gguf, where bench_peers.py looks.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
model_dir="${1:-$("$python" -c 'from dspark.model.model_store import resolve_model_dir; print(resolve_model_dir())')}"
out="${2:-$HOME/.cache/dspark/gguf/$(basename "$model_dir")-bf16.gguf}"
version="$("$python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')" || {
  echo "make_gguf.sh: llama-cpp-python is not installed (.venv/bin/pip install llama-cpp-python)" >&2; exit 1; }
# the converter tries a sentencepiece vocabulary first and needs the package importable for that
"$python" -c 'import sentencepiece' 2>/dev/null || "$python" -m pip install -q sentencepiece
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
# The converter picks the architecture from config.json's "architectures", which the directory
# dspark converts from the model's GGUF package does not write: a copy that names it (weights linked).
mkdir -p "$work/model"
for f in "$model_dir"/*; do ln -s "$(readlink -f "$f")" "$work/model/"; done
rm "$work/model/config.json"
"$python" - "$model_dir/config.json" "$work/model/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
if not config.get("architectures"):
    config["architectures"] = [names[config["model_type"]]]
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY
mkdir -p "$(dirname "$out")"
# the converter imports the gguf-py package next to it (vendor/llama.cpp/gguf-py)
"$python" "$work"/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py "$work/model" --outtype bf16 --outfile "$out"
echo "wrote $out"
