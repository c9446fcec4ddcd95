"""Checkpoints are loaded from safetensors only: no code path unpickles a file.

Specification: a model directory with pickled weights only (pytorch_model.bin) is refused with a
message, never unpickled; and no module of the serving system (dspark/, gateway/, services/)
calls torch.load, pickle/dill/joblib loading, or numpy loading with pickles allowed (a pickle
runs arbitrary code when loaded, so a checkpoint from elsewhere must not be one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dspark.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dspark", "gateway", "services")
UNPICKLING = re.compile(r"torch\.load\(|\bpickle\.loads?\(|^\s*import (c?pickle|dill|joblib)\b|^\s*from (c?pickle|dill|joblib) import"
                        r"|allow_pickle\s*=\s*True|weights_only\s*=\s*False", re.MULTILINE)


def test_a_directory_with_only_pickled_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    marker = tmp_path / "unpickled"

    class Payload:  # unpickling this would create the marker file
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"payload": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        Transformer.from_dir(tmp_path)
    assert not marker.exists()


def test_no_serving_module_unpickles_anything():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for match in UNPICKLING.finditer(path.read_text()):
                line = path.read_text().count("\n", 0, match.start()) + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group().strip()}")
    assert offenders == [], "load safetensors (safetensors.safe_open / load_file), never pickles:\n" + "\n".join(offenders)


def test_the_scan_finds_an_unpickling_call():
    assert UNPICKLING.search("state = torch.load(path, map_location='cpu')")
    assert UNPICKLING.search("import pickle\n")
    assert UNPICKLING.search("np.load(path, allow_pickle=True)")
    assert not UNPICKLING.search("from safetensors.torch import load_file\nload_file(path)")
