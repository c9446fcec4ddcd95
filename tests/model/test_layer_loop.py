"""The C++ layer loop (dspark/model/layer_loop.py) is the Python loop of Transformer._forward_fused
run from C++: the same kernels with the same arguments, so the same bits, on every forward shape
the engine issues (prefills of several requests, decode rows, verify blocks, captured layers)."""

from __future__ import annotations

import pytest
import torch

from dspark.model import compact_weights
from tests.conftest import make_tiny_runtime

pytestmark = pytest.mark.skipif(not compact_weights.available(), reason="no C++ compiler")


def _forwards(runtime, *, native: bool, monkeypatch, capture: bool) -> list:
    """Two prefills, then decode + verify rows over the caches, then one request alone."""
    monkeypatch.setenv("DSPARK_LAYER_LOOP", "1" if native else "0")
    assert (runtime.model.native_layer_loop() is not None) == native
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, runtime.vocab_size, (60,), generator=g)
    for rid in ("a", "b"):
        runtime.add_request(rid, 64)
    outs = [runtime.forward(["a", "b"], ids[:33], [21, 12], capture=capture),  # two prefills
            runtime.forward(["a", "b"], ids[33:42], [1, 8], capture=capture),  # a decode row and a verify block
            runtime.forward(["b"], ids[42:43], [1], capture=capture)]
    for rid in ("a", "b"):
        runtime.free_request(rid)
    return outs


@pytest.mark.parametrize("capture", [False, True])
def test_the_cpp_layer_loop_computes_the_bits_of_the_python_loop(monkeypatch, capture):
    runtime = make_tiny_runtime(compact=True, seed=7, intermediate_size=160, capture_layers=(3, 0, 2))
    native = _forwards(runtime, native=True, monkeypatch=monkeypatch, capture=capture)
    python = _forwards(runtime, native=False, monkeypatch=monkeypatch, capture=capture)
    for got, want in zip(native, python):
        assert torch.equal(got.hidden, want.hidden)
        assert torch.equal(got.logits, want.logits)
        if capture:
            assert got.captured.shape == (got.hidden.shape[0], 3, runtime.model.config.hidden_size)
            assert torch.equal(got.captured, want.captured)
        else:
            assert got.captured is None and want.captured is None


def test_the_layer_loop_serves_compact_fused_models_only(monkeypatch):
    monkeypatch.delenv("DSPARK_LAYER_LOOP", raising=False)
    compact = make_tiny_runtime(compact=True, seed=1)
    assert compact.model.native_layer_loop() is not None
    compact.model.set_fused(False)  # the torch-ops path has no C++ twin: the Python loop runs
    assert compact.model.native_layer_loop() is None
    compact.model.set_fused(True)
    assert compact.model.native_layer_loop() is not None
    assert make_tiny_runtime(compute_dtype=torch.bfloat16, seed=1).model.native_layer_loop() is None
    assert make_tiny_runtime(compute_dtype=torch.float32, seed=1).model.native_layer_loop() is None
