"""The SPS(B) profile (dspark/profiling/sps.py): what it measures and how the scheduler reads it."""

from __future__ import annotations

import numpy as np

from dspark.profiling.sps import SPSProfile, profile_sps


def test_every_batch_size_up_to_17_is_measured_where_a_gemm_tile_can_step(tiny_runtime):
    profile = profile_sps(tiny_runtime, max_batch=24, tokens_per_request=8, context_len=8, repeats=1)
    assert profile.batch_sizes == [*range(1, 18), 20, 24]
    assert all(b >= a for a, b in zip(profile.step_seconds, profile.step_seconds[1:]))  # never faster with more tokens


def test_the_grid_is_measured_in_whole_passes_so_a_slow_moment_hits_one_sample_of_many_batch_sizes(tiny_runtime):
    sizes = []
    forward = tiny_runtime.forward

    def recording(request_ids, token_ids, query_lens, **kwargs):
        if "logits_indices" not in kwargs:  # the timed forwards (the context prefill passes logits_indices)
            sizes.append(int(sum(query_lens)))
        return forward(request_ids, token_ids, query_lens, **kwargs)

    tiny_runtime.forward = recording
    try:
        profile_sps(tiny_runtime, max_batch=6, tokens_per_request=4, context_len=8, repeats=3)
    finally:
        tiny_runtime.forward = forward
    assert sizes == [1, 2, 3, 4, 5, 6] * 4  # a warm-up pass, then 3 timed passes


def test_the_table_interpolates_between_measured_points_and_extrapolates_linearly_past_the_last():
    profile = SPSProfile(batch_sizes=[1, 4, 8], step_seconds=[0.01, 0.01, 0.03])
    table = profile.table(upto=16)  # [16]
    assert np.allclose(1.0 / table[:8], [0.01, 0.01, 0.01, 0.01, 0.015, 0.02, 0.025, 0.03])
    assert np.isclose(1.0 / table[15], 0.06)
