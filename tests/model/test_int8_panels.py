"""The int8-activation GEMM on column panels (dspark/model/int8_panels.py) computes the first
int8 kernel's product bit for bit: on its VNNI path and on its AMX-tile path, at every number of
rows, for both weight formats, whatever N (padded to whole panels) or K (partial groups of blocks)."""

from __future__ import annotations

import pytest
import torch

from dspark.model import compact_weights as cw
from dspark.model import int8_panels as p16
from tests.conftest import q4_1_exact, q8_0_exact

pytestmark = pytest.mark.skipif(not cw.panels_available(), reason="the panel GEMM needs AVX-512 F, BW and VNNI")

# K = 64: one partial group; 256: one full group; 576 and 1536: the default model's
SHAPES = [(21, 64), (37, 256), (16, 576), (50, 1536)]
ROWS = [1, 2, 3, 5, 8, 15, 16, 17, 33]
ON_THE_GRID = {"q4_1": q4_1_exact, "q8_0": q8_0_exact}
PATHS = ["vnni", "amx"]


@pytest.fixture(params=PATHS)
def path(request):
    """Force the panel GEMM onto one path for every row count (a speed choice otherwise)."""
    if request.param == "amx" and not cw.panels_use_amx():
        pytest.skip("this CPU (or this kernel's build) has no AMX-INT8 tiles")
    previous = cw.set_panel_amx_min_rows(1 if request.param == "amx" else 1 << 30)
    yield request.param
    cw.set_panel_amx_min_rows(previous)


def _weights(fmt: str, n: int, k: int) -> tuple[cw.CompactWeight, cw.CompactWeight]:
    """The same weights in the first kernel's layout and on panels."""
    w = ON_THE_GRID[fmt](torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) / k**0.5)
    exact = cw.compact(w, formats=(fmt,))
    first, panels = cw.with_int8_activations(exact, panels=False), cw.with_int8_activations(exact, panels=True)
    assert (first.format, panels.format) == (f"{fmt}_x8", f"{fmt}_p16")
    return first, panels


def _rows(m: int, k: int, seed: int) -> torch.Tensor:  # [m, k]: activations of varied scale
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, k)
    x[0, :32] = 0.0  # an all-zero block (amax 0, scale 0)
    return x


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_panels_compute_the_first_kernels_bits_at_every_row_count(fmt, path):
    for n, k in SHAPES:
        first, panels = _weights(fmt, n, k)
        for m in ROWS:
            x = _rows(m, k, seed=m)
            assert torch.equal(cw.matmul(x, panels), cw.matmul(x, first)), f"{fmt}, N = {n}, K = {k}, M = {m}, {path}"


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_path():
    """Batch invariance across paths: one row alone (VNNI) equals the same row among 40 (AMX)."""
    first, panels = _weights("q4_1", 37, 576)
    x = _rows(40, 576, seed=3)
    alone = torch.stack([cw.matmul(x[i : i + 1], panels)[0] for i in range(40)])
    assert torch.equal(cw.matmul(x, panels), alone)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_packing_keeps_every_weight(fmt):
    for n, k in SHAPES:
        first, panels = _weights(fmt, n, k)
        assert torch.equal(cw.decode(panels), cw.decode(first))
        assert panels.q.shape[0] == (n + p16.PANEL - 1) // p16.PANEL  # whole panels, zero columns appended


def test_scales_and_values_round_trip_through_the_panel_layouts():
    g = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (37, 18, 32), generator=g)
    q8 = torch.randint(-127, 128, (37, 18, 32), generator=g)
    d = torch.rand(37, 18, generator=g)
    assert torch.equal(p16.unpack_q4_1(p16.pack_q4_1(q4), 37), q4)
    assert torch.equal(p16.unpack_q8_0(p16.pack_q8_0(q8), 37), q8)
    assert torch.equal(p16.unpack_scales(p16.pack_scales(d), 37), d)
    sums = p16.q8_column_sums(q8)  # [P, 18, 16]
    assert torch.equal(p16.unpack_scales(sums.float(), 37).long(), 128 * q8.sum(-1))
    with pytest.raises(ValueError, match="-127..127"):
        p16.pack_q8_0(torch.full((1, 1, 32), -128))


def test_the_default_choice_is_the_panel_layout_where_the_cpu_has_it():
    w = q4_1_exact(torch.randn(16, 256, generator=torch.Generator().manual_seed(1)))
    assert cw.with_int8_activations(cw.compact(w, formats=("q4_1",))).format == "q4_1_p16"
