"""SPS(B): verifier steps per second as a function of the batch size B in tokens.

The prefix scheduler (docs/method.md §5.1) maximises τ·SPS(B), so it needs this curve for the
hardware it runs on. It is measured once at start-up on dummy requests shaped like verification
batches (requests of up to γ+1 query tokens over a cached context), at a grid of batch sizes,
and interpolated linearly in step time in between. Run `dspark profile` to print it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dspark.model.target_runtime import TargetRuntime

# Every B up to 17: a CPU GEMM's cost rises in steps of its row tile (4 rows on AVX2, 8 on
# AVX-512: B = 5 costs 1.4-1.7x B = 4 on compact weights), and the scheduler must see the step
# where it is, not a line drawn across it from B = 8 to B = 10.
_GRID = [*range(1, 18), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


@dataclass
class SPSProfile:
    batch_sizes: list[int]  # measured B, ascending
    step_seconds: list[float]  # forward time at each B (the fastest pass)

    def step_time(self, batch_size: int) -> float:
        """Seconds per verifier step of `batch_size` tokens (linear in between measured points,
        proportional to B beyond the last one: the regime there is compute-bound)."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        bs, ts = self.batch_sizes, self.step_seconds
        if batch_size >= bs[-1]:
            return ts[-1] * batch_size / bs[-1]
        if batch_size <= bs[0]:
            return ts[0]
        for (b0, t0), (b1, t1) in zip(zip(bs, ts), zip(bs[1:], ts[1:])):
            if b0 <= batch_size <= b1:
                return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
        raise AssertionError("unreachable")

    def sps(self, batch_size: int) -> float:
        return 1.0 / self.step_time(batch_size)

    def table(self, upto: int | None = None) -> np.ndarray:  # [upto] SPS at index B-1
        """SPS for B = 1..upto, what the vectorised scheduler looks up: the same interpolation as
        `step_time`, vectorised (the engine asks for it every round)."""
        upto = upto or self.batch_sizes[-1]
        b = np.arange(1, upto + 1, dtype=np.float64)  # [upto]
        last_b, last_t = self.batch_sizes[-1], self.step_seconds[-1]
        t = np.interp(b, self.batch_sizes, self.step_seconds)  # clamps to the first point below it
        t = np.where(b >= last_b, last_t * b / last_b, t)
        return 1.0 / t

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SPSProfile":
        return cls(**json.loads(text))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_sps(
    runtime: TargetRuntime,
    *,
    max_batch: int = 64,
    tokens_per_request: int = 8,
    context_len: int = 128,
    repeats: int = 5,
) -> SPSProfile:
    """Time one verifier forward for each grid B <= max_batch (the fastest of `repeats` passes of the grid)."""
    if max_batch < 1 or tokens_per_request < 1:
        raise ValueError(f"need max_batch >= 1 and tokens_per_request >= 1, got {max_batch}, {tokens_per_request}")
    grid = [b for b in _GRID if b <= max_batch]
    if grid[-1] != max_batch:
        grid.append(max_batch)
    num_requests = -(-max_batch // tokens_per_request)
    ids = [f"__sps_profile_{i}" for i in range(num_requests)]
    gen = torch.Generator().manual_seed(0)
    vocab = runtime.vocab_size
    try:
        for rid in ids:
            runtime.add_request(rid, context_len + tokens_per_request)
        runtime.forward(ids, torch.randint(0, vocab, (num_requests * context_len,), generator=gen), [context_len] * num_requests,
                        logits_indices=torch.empty(0, dtype=torch.long))
        # Passes over the whole grid rather than `repeats` runs of one B after another: a moment
        # of load from another process then slows one sample of many B, not every sample of a
        # few neighbouring B (which bent the curve by 30-60 % on a shared 2-core host). Each B
        # keeps its fastest pass: interference only adds time, and the minimum put the steps of
        # the GEMM tiles (B = 5 / 4, 9 / 8, 17 / 16) on the same side of what pays in 4 of 4
        # profiles where the median did in 1 of 4.
        samples: list[list[float]] = [[] for _ in grid]  # [len(grid)][repeats]
        for rep in range(repeats + 1):  # the first pass warms caches and allocator
            for g, b in enumerate(grid):
                lens = [min(tokens_per_request, b - i * tokens_per_request) for i in range(-(-b // tokens_per_request))]
                batch_ids = ids[: len(lens)]
                tokens = torch.randint(0, vocab, (b,), generator=gen)
                t0 = time.perf_counter()
                runtime.forward(batch_ids, tokens, lens)
                synchronize(runtime.device)  # a GPU step ends when its kernels do, not when they are queued
                if rep:
                    samples[g].append(time.perf_counter() - t0)
                for rid in batch_ids:
                    runtime.truncate(rid, context_len)
        times = [min(s) for s in samples]
    finally:
        for rid in ids:
            runtime.free_request(rid)
    # A bigger batch is never faster per step; a noisy sample that says so (another process took
    # the CPU for a moment) would mislead the scheduler, so step time is made non-decreasing.
    monotone = [max(times[: i + 1]) for i in range(len(times))]
    return SPSProfile(batch_sizes=grid, step_seconds=monotone)
