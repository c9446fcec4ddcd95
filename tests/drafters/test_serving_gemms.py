"""The drafters' serving GEMMs (dspark/drafters/serving_gemms.py) compute what the plain layers
compute, and a row's result does not depend on the other rows in the batch, on both kernels:
oneDNN packed fp32 (weights kept in fp32) and the compact kernel (weights with an exact compact
format: a checkpoint stored in bf16, the target's q8_0 LM head).

Tolerance against nn.Linear: fp32 on both sides, different reduction orders, so atol 1e-5 +
rtol 1e-5 on outputs of magnitude ~10 (inputs and weights ~N(0, 1), K up to 2,880). The row
invariance is exact: that is what lets a seeded request draw the same drafts alone or batched.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.drafters import serving_gemms
from dspark.drafters.serving_gemms import CompactGemm, ServingLinear, packed_gemm, prepare_for_serving, serving_gemm
from dspark.model import compact_weights

pytestmark = pytest.mark.skipif(not serving_gemms.ENABLED or not torch.backends.mkldnn.is_available(),
                                reason="the packed path needs oneDNN (and DSPARK_DRAFTER_GEMMS not 'plain')")

# (in, out) of the shipped DSpark drafter's layers: qkv, o, gate/up, down (K > 1024: split),
# W_c over five target layers (K = 2,880), the draft-vocabulary LM head, the Markov head's W2ᵀ
DRAFTER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (2880, 576), (576, 8192), (64, 8192)]
KERNELS = ["packed", "compact"]


def weight_for(kernel: str, out_features: int, in_features: int) -> torch.Tensor:
    """A random weight [out, in] that `serving_gemm` sends to `kernel`: fp32 values, or bf16 ones."""
    w = torch.randn(out_features, in_features) * in_features ** -0.5 * 3
    return w if kernel == "packed" else w.bfloat16().float()


def skip_without(kernel: str) -> None:
    if kernel == "compact" and not (serving_gemms._MODE == "auto" and compact_weights.available()):
        pytest.skip("the compact kernel is not built here (or DSPARK_DRAFTER_GEMMS=packed)")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("in_features,out_features", DRAFTER_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_a_serving_linear_computes_what_the_plain_layer_computes(kernel, in_features, out_features, bias):
    skip_without(kernel)
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        plain.weight.copy_(weight_for(kernel, out_features, in_features))
    x = torch.randn(2, 7, in_features)  # [rows, block, in]: leading dims are kept
    with torch.no_grad():
        expected = plain(x)
        served = ServingLinear(plain)
        got = served(x)
    assert isinstance(served.__dict__["gemm"], CompactGemm) == (kernel == "compact")
    assert got.shape == expected.shape == (2, 7, out_features)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_q8_0_weight_such_as_the_targets_lm_head_goes_to_the_compact_kernel():
    skip_without("compact")
    torch.manual_seed(3)
    scale = torch.rand(576, 576 // 32, 1) / 1024  # fp32 scales that are fp16 values (weights up to ~0.12)
    q = torch.randint(-127, 128, (576, 576 // 32, 32)).float()
    q[..., 0] = 127  # each block reaches the top of the range, as GGUF's quantiser writes it
    w = (scale.half().float() * q).view(576, 576)
    gemm = serving_gemm(w)
    assert isinstance(gemm, CompactGemm) and gemm.weight.format == "q8_0"
    x = torch.randn(7, 576)
    torch.testing.assert_close(gemm(x), x @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("in_features,out_features", DRAFTER_SHAPES)
def test_a_rows_result_does_not_depend_on_the_other_rows_in_the_batch(kernel, in_features, out_features):
    skip_without(kernel)
    torch.manual_seed(1)
    gemm = serving_gemm(weight_for(kernel, out_features, in_features))
    assert isinstance(gemm, CompactGemm) == (kernel == "compact")
    x = torch.randn(70, in_features)  # up to ten requests' blocks of 7
    alone = torch.cat([gemm(x[i : i + 1]) for i in range(x.shape[0])])  # [70, out] one row at a time
    for rows in (2, 7, 14, 21, 35, 49, 70):
        assert torch.equal(gemm(x[:rows]), alone[:rows]), f"{rows} rows differ from the same rows alone"


def test_prepare_for_serving_swaps_every_wide_linear_and_keeps_the_weights_readable():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 1)))
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = model(x)
        weight = model[0].weight
        prepare_for_serving(model)
        got = model(x)
    assert isinstance(model[0], ServingLinear) and isinstance(model[2][0], ServingLinear)
    assert type(model[2][1]) is nn.Linear  # one output: faster unpacked (serving_gemms.MIN_OUT_FEATURES)
    assert model[0].weight is weight  # code that slices a layer's weight still reads it
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
