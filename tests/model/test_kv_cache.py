"""KVCache: budget accounting, admission control, and truncation back to the accepted prefix."""

from __future__ import annotations

import pytest
import torch

from dspark.model.config import ModelConfig
from dspark.model.kv_cache import KVBudgetExceeded, KVCache


@pytest.fixture
def cache() -> KVCache:
    return KVCache(ModelConfig.tiny(), budget_tokens=100, dtype=torch.bfloat16)


def test_allocating_reserves_the_requested_tokens_of_the_budget(cache):
    assert (cache.reserved_tokens, cache.free_tokens) == (0, 100)
    kv = cache.allocate("a", 30)
    cache.allocate("b", 50)
    assert (cache.reserved_tokens, cache.free_tokens) == (80, 20)
    assert cache.can_allocate(20) and not cache.can_allocate(21)
    # one contiguous buffer per K and V, sized to the reservation, empty to start with
    c = ModelConfig.tiny()
    assert kv.keys.shape == kv.values.shape == (c.num_layers, c.num_kv_heads, 30, c.head_dim)
    assert kv.keys.dtype == torch.bfloat16
    assert kv.capacity == 30 and kv.length == 0
    assert cache.get("a") is kv


def test_a_request_that_does_not_fit_raises_kv_budget_exceeded_and_reserves_nothing(cache):
    cache.allocate("a", 90)
    with pytest.raises(KVBudgetExceeded, match=r"request 'b' needs 11 KV tokens, 10 of 100 are free"):
        cache.allocate("b", 11)
    assert cache.reserved_tokens == 90 and "b" not in cache.requests
    cache.allocate("b", 10)  # exactly the rest fits
    assert cache.free_tokens == 0


def test_kv_budget_exceeded_is_a_runtime_error_not_a_value_error():
    # Callers queue the request on KVBudgetExceeded but reject it on ValueError: they must differ.
    assert issubclass(KVBudgetExceeded, RuntimeError) and not issubclass(KVBudgetExceeded, ValueError)


def test_freeing_a_request_returns_its_reservation_and_is_idempotent(cache):
    cache.allocate("a", 60)
    cache.allocate("b", 40)
    cache.free("a")
    assert (cache.reserved_tokens, cache.free_tokens) == (40, 60)
    cache.free("a")  # already freed: nothing to do
    cache.free("never-added")
    assert cache.reserved_tokens == 40
    cache.allocate("c", 60)  # the freed budget is usable again
    assert cache.free_tokens == 0


def test_bad_allocations_are_value_errors(cache):
    cache.allocate("a", 10)
    with pytest.raises(ValueError, match="'a' already has a KV cache"):
        cache.allocate("a", 10)
    with pytest.raises(ValueError, match="max_tokens must be positive, got 0"):
        cache.allocate("b", 0)
    assert cache.reserved_tokens == 10
    with pytest.raises(ValueError, match="KV budget must be positive, got 0"):
        KVCache(ModelConfig.tiny(), budget_tokens=0, dtype=torch.float32)


def test_unknown_requests_raise_key_error_naming_them(cache):
    with pytest.raises(KeyError, match="'ghost' has no KV cache"):
        cache.get("ghost")
    with pytest.raises(KeyError, match="'ghost' has no KV cache"):
        cache.truncate("ghost", 0)
    cache.allocate("a", 10)
    cache.free("a")
    with pytest.raises(KeyError, match="already freed"):
        cache.get("a")


def test_truncate_only_shortens_the_valid_prefix(cache):
    kv = cache.allocate("a", 10)
    kv.length = 6
    cache.truncate("a", 4)
    assert kv.length == 4
    cache.truncate("a", 4)  # no-op
    for bad in (5, -1):
        with pytest.raises(ValueError, match=f"cannot truncate request 'a' of length 4 to {bad}"):
            cache.truncate("a", bad)
    cache.truncate("a", 0)
    assert kv.length == 0
    assert cache.reserved_tokens == 10  # truncation keeps the reservation


def test_after_truncating_rejected_tokens_the_next_forward_is_as_if_they_were_never_sent(tiny_runtime):
    """Verify [x_0, d_1, d_2, d_3], accept d_1 only, continue: bit-identical (bf16) to a request
    that only ever saw [x_0, d_1]."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (9,), generator=g)
    x0, drafts, after = torch.randint(0, 256, (1,), generator=g), torch.randint(0, 256, (3,), generator=g), torch.randint(0, 256, (4,), generator=g)
    for rid in ("speculated", "clean"):
        tiny_runtime.add_request(rid, 32)
        tiny_runtime.forward([rid], prompt, [9])

    tiny_runtime.forward(["speculated"], torch.cat([x0, drafts]), [4])
    tiny_runtime.truncate("speculated", 9 + 2)  # keep x_0 and d_1
    tiny_runtime.forward(["clean"], torch.cat([x0, drafts[:1]]), [2])
    assert tiny_runtime.context_len("speculated") == tiny_runtime.context_len("clean") == 11

    speculated = tiny_runtime.forward(["speculated"], after, [4])
    clean = tiny_runtime.forward(["clean"], after, [4])
    assert torch.equal(speculated.hidden, clean.hidden)
    torch.testing.assert_close(speculated.logits, clean.logits, atol=0, rtol=0)


def test_truncate_to_zero_then_prefill_again_gives_the_original_prefill(tiny_runtime):
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(8))
    tiny_runtime.add_request("a", 32)
    first = tiny_runtime.forward(["a"], prompt, [12])
    tiny_runtime.forward(["a"], torch.tensor([1, 2, 3]), [3])
    tiny_runtime.truncate("a", 0)
    again = tiny_runtime.forward(["a"], prompt, [12])
    assert torch.equal(first.hidden, again.hidden)


def test_the_runtime_reserves_and_releases_kv_through_the_budget(tiny_runtime_factory):
    runtime = tiny_runtime_factory(kv_budget_tokens=100)
    runtime.add_request("a", 70)
    with pytest.raises(KVBudgetExceeded):
        runtime.add_request("b", 31)
    assert not runtime.has_request("b")
    runtime.free_request("a")
    assert runtime.kv.reserved_tokens == 0 and not runtime.has_request("a")
    runtime.add_request("b", 100)
