"""Time the prefix scheduler (Algorithm 1) per round: the vectorised `schedule` vs its reference.

The scheduler runs on the host once per round, on the critical path between drafting and
verification, so its cost must stay far below a verifier step (target: under 1 ms at R = 512,
γ = 16). Inputs: confidences drawn as a trained drafter's look (mostly high, decaying with
position), and the SPS table of the default model measured on this machine (docs/results/forward.md,
B = 1..256, step time ∝ B beyond), extended to B = R·(1 + γ) as `SPSProfile.table` does.
Also times the worst case (a flat SPS table: Θ rises with every admission, so every candidate
is ranked), the no-break full search and the async variant (capacity search + top-K).

    python benchmarks/bench_scheduler.py [--runs 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import median, print_table

from dspark.profiling.sps import SPSProfile
from dspark.scheduling.prefix_scheduler import schedule, schedule_async, schedule_full_search, schedule_reference

# Our runtime on SmolLM2-135M (bf16) on this 2-core CPU, from `python benchmarks/bench_forward.py`
# (docs/results/forward.md); pass --profile-json with the output of `dspark profile --json` to use another one.
PROFILE = SPSProfile(
    batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
    step_seconds=[0.0271, 0.0303, 0.0319, 0.0393, 0.0560, 0.0928, 0.168, 0.312, 0.580],  # first run, see docs/results/forward.md
)
REQUESTS = (1, 8, 32, 128, 512)
GAMMAS = (7, 16)


def drafter_like_confidences(rng: np.random.Generator, num_requests: int, gamma: int) -> np.ndarray:  # [R, γ]
    """Per-request quality q ~ U(0.5, 1), c_{r,j} ≈ q decaying slowly with j, plus noise."""
    quality = rng.uniform(0.5, 1.0, (num_requests, 1))  # [R, 1]
    decay = 0.98 ** np.arange(gamma)  # [γ]
    return np.clip(quality * decay + rng.normal(0.0, 0.05, (num_requests, gamma)), 0.0, 1.0)


def time_us(fn, runs: int) -> float:
    """Median wall time of `fn()` in microseconds (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="timed runs per cell (the reference gets a tenth)")
    parser.add_argument("--profile-json", default=None, help="an SPS profile from `dspark profile --json`")
    args = parser.parse_args()
    profile = PROFILE if args.profile_json is None else SPSProfile.from_json(open(args.profile_json).read())
    rng = np.random.default_rng(0)
    rows = []
    for gamma in GAMMAS:
        for num_requests in REQUESTS:
            c = drafter_like_confidences(rng, num_requests, gamma)  # [R, γ]
            stale = drafter_like_confidences(rng, num_requests, gamma)  # [R, γ]
            table = np.asarray(profile.table(upto=num_requests * (1 + gamma)))  # [R·(1+γ)], converted once
            ell = schedule(confidences=c, sps_table=table)
            assert np.array_equal(ell, schedule_reference(confidences=c, sps_table=table))
            fast = time_us(lambda c=c, table=table: schedule(confidences=c, sps_table=table), args.runs)
            flat = np.ones_like(table)  # worst case: Θ rises with every admission, all R·γ candidates get ranked
            worst = time_us(lambda c=c, flat=flat: schedule(confidences=c, sps_table=flat), args.runs)
            full = time_us(lambda c=c, table=table: schedule_full_search(confidences=c, sps_table=table), args.runs)
            asyn = time_us(
                lambda c=c, s=stale, table=table: schedule_async(confidences=c, stale_confidences=s, sps_table=table), args.runs
            )
            ref = time_us(lambda c=c, table=table: schedule_reference(confidences=c, sps_table=table), max(5, args.runs // 10))
            rows.append([num_requests, gamma, int(ell.sum()), f"{fast:.1f}", f"{worst:.1f}", f"{full:.1f}", f"{asyn:.1f}", f"{ref:.1f}"])
    print(f"median of {args.runs} runs, microseconds. admitted = Σ ℓ_r chosen by Algorithm 1 on the default model's")
    print("profile; schedule_flat_us = the same confidences with a flat SPS table (every candidate admitted: worst case)")
    headers = ["R", "gamma", "admitted", "schedule_us", "schedule_flat_us", "full_search_us", "async_us", "reference_us"]
    print_table(headers, rows)


if __name__ == "__main__":
    main()
