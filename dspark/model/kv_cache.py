"""Per-request KV caches under one memory budget.

Each request owns one contiguous buffer per K and V, sized when the request is admitted to the
longest sequence it may reach (prompt + max new tokens + one draft block). Reserving up front
means a running request can never run out of cache mid-generation: when the budget is full,
`allocate` raises `KVBudgetExceeded` and the caller queues the request instead of crashing.
Contiguous buffers keep CPU attention a plain strided SDPA over `[:length]`, with no page
gather; a paged pool would waste less on short outputs and is the natural next step for GPUs.

Invariant: `length` tokens of a request are valid; speculative tokens are appended by the
forward pass and dropped by `truncate` when the verifier rejects them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.model.config import ModelConfig


class KVBudgetExceeded(RuntimeError):
    """Not enough KV memory left to admit a request now (queue it and retry later)."""


@dataclass
class RequestKV:
    keys: torch.Tensor  # [num_layers, num_kv_heads, capacity, head_dim]
    values: torch.Tensor  # [num_layers, num_kv_heads, capacity, head_dim]
    length: int = 0  # tokens whose K/V are valid

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]


class KVCache:
    def __init__(self, config: ModelConfig, *, budget_tokens: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if budget_tokens <= 0:
            raise ValueError(f"KV budget must be positive, got {budget_tokens} tokens")
        self.config = config
        self.budget_tokens = budget_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.requests: dict[str, RequestKV] = {}
        self.reserved_tokens = 0

    @property
    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    def can_allocate(self, max_tokens: int) -> bool:
        return max_tokens <= self.free_tokens

    def allocate(self, request_id: str, max_tokens: int) -> RequestKV:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already has a KV cache")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if max_tokens > self.free_tokens:
            raise KVBudgetExceeded(
                f"request {request_id!r} needs {max_tokens} KV tokens, {self.free_tokens} of "
                f"{self.budget_tokens} are free"
            )
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, max_tokens, c.head_dim)
        kv = RequestKV(
            keys=torch.empty(shape, dtype=self.dtype, device=self.device),
            values=torch.empty(shape, dtype=self.dtype, device=self.device),
        )
        self.requests[request_id] = kv
        self.reserved_tokens += max_tokens
        return kv

    def free(self, request_id: str) -> None:
        kv = self.requests.pop(request_id, None)
        if kv is not None:
            self.reserved_tokens -= kv.capacity

    def get(self, request_id: str) -> RequestKV:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} has no KV cache (never added, or already freed)") from None

    def truncate(self, request_id: str, length: int) -> None:
        """Keep only the first `length` tokens (drop rejected speculative tokens)."""
        kv = self.get(request_id)
        if not 0 <= length <= kv.length:
            raise ValueError(f"cannot truncate request {request_id!r} of length {kv.length} to {length}")
        kv.length = length
