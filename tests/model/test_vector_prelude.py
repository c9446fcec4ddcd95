"""The kernels' 16-lane vectors (dspark/model/attention.py, VECTOR_PRELUDE) have two spellings:
native GCC vectors, and pairs of 8-lane halves on AVX2 CPUs without AVX-512 (where a 64-byte
vector has no register). The pairs are a speed fix only: every kernel must compute the same bits
with either, so an AVX2 machine and an AVX-512 machine serve the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import avx2_without_avx512

REPO = Path(__file__).resolve().parents[2]


# One prefill and one 10-token verify-shaped step of a tiny model, in every kernel path: compact
# weights (fp32 activations: compact GEMM, fused ops, attention) and dense bf16 (the fused ops'
# bf16 loads and stores). The logits and hidden states go to a file for the parent to compare.
_FORWARDS = r"""
import sys, torch
from dspark.model import attention
from tests.conftest import make_tiny_runtime
assert attention.kernel_available()
out = {}
for name, kwargs in (("compact", dict(compact=True)), ("bf16", dict())):
    runtime = make_tiny_runtime(seed=3, **kwargs)
    assert runtime.model.fused and runtime.model.attention == "batched", name
    ids = torch.randint(0, runtime.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    runtime.add_request("a", 64)
    runtime.add_request("b", 64)
    first = runtime.forward(["a", "b"], ids[:35], [20, 15])  # two prefills
    step = runtime.forward(["a", "b"], ids[35:], [7, 3])  # verify-shaped rows over the caches
    out[name] = [first.logits, first.hidden, step.logits, step.hidden]
torch.save(out, sys.argv[1])
"""


def _forwards(tmp_path: Path, native: bool) -> dict:
    path = tmp_path / f"native{int(native)}.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSPARK_NATIVE_V16": "1" if native else "0"}
    subprocess.run([sys.executable, "-c", _FORWARDS, str(path)], cwd=REPO, env=env, check=True, timeout=600)
    return torch.load(path, weights_only=True)


@pytest.mark.processes
@pytest.mark.skipif(not avx2_without_avx512(),
                    reason="the 8-lane pairs are built only on AVX2 CPUs without AVX-512")
def test_the_avx2_pairs_give_the_bits_of_the_native_16_lane_vectors(tmp_path):
    pairs, native = _forwards(tmp_path, native=False), _forwards(tmp_path, native=True)
    for name in ("compact", "bf16"):
        for got, want in zip(pairs[name], native[name]):
            assert torch.equal(got, want), name
