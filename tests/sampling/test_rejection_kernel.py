"""The fused Triton kernel equals the torch reference token for token, on the same random numbers.

On a CPU the kernel runs under the Triton interpreter, which must be switched on (TRITON_INTERPRET=1)
before triton is first imported in a process. So that this holds whatever order pytest imports
modules in, and without switching the interpreter on for other tests, the kernel checks run
in-process only when this process already runs triton interpreted; otherwise all of them run
once in a child pytest under TRITON_INTERPRET=1 and each test here asserts its own outcome there.
With CUDA, `test_compiled_kernel_on_cuda_matches_the_reference` also runs the compiled kernel.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.sampling import SamplingParams, logits_to_probs, rejection_sample
from dspark.sampling.rejection_sampler import prepare_batch, rejection_sample_reference
from tests.sampling.conftest import LAST_UNIFORM_BELOW_ONE, rounding_vocab

pytestmark = pytest.mark.processes  # without TRITON_INTERPRET=1 the kernel tests run in a child pytest

_CHILD_FLAG = "DSPARK_REJECTION_KERNEL_TEST_CHILD"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _interpreter_active() -> bool:
    """Whether this process imported triton (and the kernel) with the interpreter on."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False  # decided without importing triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from dspark.sampling import rejection_kernel

    return isinstance(tl.standard.argmax, InterpretedFunction) and isinstance(
        rejection_kernel._rejection_kernel, InterpretedFunction
    )


@functools.cache
def _child_outcomes() -> tuple[dict[str, str], str]:
    """Run this module's tests once in a child pytest with TRITON_INTERPRET=1: {test name: outcome}, log."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_FLAG: "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=_REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    lines = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED)\s+\S+?::(\w+)", log, re.M)
    outcomes = {name: outcome for outcome, name in lines}
    return outcomes, log


def interpreted(test):
    """Run `test` here if this process's triton is interpreted, else assert its outcome in the child."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if _interpreter_active():
            return test(*args, **kwargs)
        if os.environ.get(_CHILD_FLAG):
            pytest.fail("TRITON_INTERPRET=1 was set but triton was imported without the interpreter")
        outcomes, log = _child_outcomes()
        outcome = outcomes.get(test.__name__)
        assert outcome == "PASSED", f"{test.__name__} under TRITON_INTERPRET=1 (child pytest): {outcome}\n{log[-6000:]}"

    return wrapper


def _assert_backends_agree(batch, **kernel_kwargs):
    """The kernel (via its wrapper, so block_v can force several vocab tiles) equals the reference."""
    from dspark.sampling.rejection_kernel import rejection_sample_triton

    prep = prepare_batch(batch)
    ref = rejection_sample_reference(prep)
    out, num_accepted = rejection_sample_triton(
        draft_token_ids=prep.draft_token_ids,
        cu_num_draft=prep.cu_num_draft,
        target=prep.target,
        is_greedy=prep.is_greedy,
        draft_probs=prep.draft_probs,
        uniforms=prep.uniforms,
        exp_noise=prep.exp_noise,
        max_num_draft=prep.max_num_draft,
        **kernel_kwargs,
    )
    assert torch.equal(out.cpu(), ref.output_token_ids.cpu()), (out, ref.output_token_ids)
    assert torch.equal(num_accepted.cpu(), ref.num_accepted.cpu())
    return ref


@interpreted
def test_kernel_equals_reference_on_mixed_batches(mixed_batch):
    accepted = 0
    for seed in range(4):
        for sparse in (False, True):
            batch = mixed_batch(seed, sparse=sparse)
            ref = _assert_backends_agree(batch, block_v=16)  # vocab 40: three tiles, the last one partial
            accepted += int(ref.num_accepted.sum())
            via_entry_point = rejection_sample(batch, backend="triton")  # default block size: one tile
            assert torch.equal(via_entry_point.output_token_ids, ref.output_token_ids)
    assert accepted > 10  # acceptances happened: the comparison covers the accept path, not only rejections


@interpreted
def test_kernel_handles_a_batch_where_every_request_has_no_draft_or_is_greedy(mixed_batch, batch_of):
    vocab = 8
    g = torch.Generator().manual_seed(3)
    requests = [
        (SamplingParams(temperature=1.0), [], torch.randn(1, vocab, generator=g), None),
        (SamplingParams(temperature=0.0), [2, 5], torch.randn(3, vocab, generator=g), None),
        (SamplingParams(temperature=0.8, top_p=0.5), [], torch.randn(1, vocab, generator=g), None),
    ]
    batch = batch_of(requests)
    assert batch.draft_probs is None
    _assert_backends_agree(batch, block_v=4)


@interpreted
def test_ties_across_vocab_tiles_go_to_the_lowest_token_id(batch_of):
    vocab = 40
    greedy_row = torch.zeros(1, vocab)
    greedy_row[0, [21, 35]] = 7.0  # tied maximum in the 2nd and 3rd tile of 16
    flat = torch.zeros(1, vocab)  # uniform p_t; with constant noise every score ties
    requests = [
        (SamplingParams(temperature=0.0), [], greedy_row, None),
        (SamplingParams(temperature=1.0), [], flat, None),
    ]
    batch = batch_of(requests, exp_noise=torch.ones(2, vocab))
    ref = _assert_backends_agree(batch, block_v=16)
    assert ref.output_token_ids.flatten().tolist() == [21, 0]


@interpreted
def test_an_all_zero_residual_falls_back_to_the_target_with_the_same_tie_rule(batch_of):
    # The drafter's row is the target's own uniform row, which sums below 1 in fp32: renormalised,
    # p_d >= p_t everywhere, max(0, p_t - p_d) is all zero, and u = 1 - 2^-24 rejects the draft;
    # the draw must come from p_t. Constant noise: all scores tie. Three vocab tiles of 16.
    vocab = rounding_vocab(33)
    target = torch.zeros(2, vocab)  # uniform p_t
    draft = logits_to_probs(target[:1], temperature=1.0)  # p_d = p_t
    requests = [(SamplingParams(temperature=1.0), [5], target, draft)]
    tied = batch_of(requests, uniforms=torch.tensor([LAST_UNIFORM_BELOW_ONE]), exp_noise=torch.ones(1, vocab))
    assert _assert_backends_agree(tied, block_v=16).output_token_ids.tolist() == [[0, -1]]
    for seed in range(5):
        _assert_backends_agree(batch_of(requests, uniforms=torch.tensor([LAST_UNIFORM_BELOW_ONE]), seed=seed), block_v=16)


@interpreted
def test_kernel_never_emits_a_token_outside_the_target_nucleus(mixed_batch):
    # Target top_k=3 and a wide spread of exponential noise: zero-weight tokens must never win.
    batch = mixed_batch(11)
    batch.params = [SamplingParams(temperature=1.0, top_k=3)] * batch.num_requests
    batch.exp_noise = torch.rand(batch.exp_noise.shape, generator=torch.Generator().manual_seed(0)) * 1e3
    ref = _assert_backends_agree(batch, block_v=8)
    lens = batch.num_draft_tokens
    last_rows = torch.cumsum(lens, 0) - lens + torch.arange(batch.num_requests) + ref.num_accepted
    last_tokens = ref.output_token_ids[torch.arange(batch.num_requests), ref.num_accepted]
    top3 = batch.target_logits[last_rows].topk(3, dim=-1).indices
    assert (top3 == last_tokens[:, None]).any(-1).all()


def _on_cuda(batch):
    for name in ("draft_token_ids", "num_draft_tokens", "target_logits", "uniforms", "exp_noise"):
        setattr(batch, name, getattr(batch, name).cuda())
    dp = batch.draft_probs
    for name in ("dense", "sparse_ids", "sparse_probs"):
        if getattr(dp, name) is not None:
            setattr(dp, name, getattr(dp, name).cuda())
    return batch


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for the compiled kernel")
@pytest.mark.parametrize("vocab, num_requests, sparse", [
    (3000, 8, False), (3000, 8, True),  # several 1024-wide tiles, every kind of request
    (49_152, 300, True),  # the default model's vocabulary, a serving-sized round (sparse rows: drafter top-k)
    (151_936, 256, True),  # Qwen3's vocabulary
    (49_152, 64, False),  # dense draft rows at a real vocabulary
], ids=["v3000", "v3000-sparse", "v49152-r300", "v151936-r256", "v49152-dense"])
def test_compiled_kernel_on_cuda_matches_the_reference(mixed_batch, vocab, num_requests, sparse):
    """scripts/gpu_check.sh runs these on the GPU: the compiled kernel and the torch reference,
    both on CUDA, emit the same tokens for every request."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs triton interpreted")
    for seed in range(4 if vocab < 10_000 else 2):
        batch = _on_cuda(mixed_batch(seed, sparse=sparse, vocab=vocab, num_requests=num_requests, max_draft=7))
        gpu_ref = rejection_sample(batch)
        gpu = rejection_sample(batch, backend="triton")
        assert torch.equal(gpu.output_token_ids, gpu_ref.output_token_ids)
        assert torch.equal(gpu.num_accepted, gpu_ref.num_accepted)
        assert int(gpu.num_accepted.sum()) > 0  # drafts were accepted: the comparison saw both paths


def test_kernel_compiles_for_hopper_with_ieee_division_and_no_contraction():
    """Ahead-of-time compile for sm_90, no GPU needed: catches what the interpreter cannot."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs triton interpreted")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dspark.sampling.rejection_kernel import _rejection_kernel

    signature = {"out_ptr": "*i64", "num_accepted_ptr": "*i64", "draft_ids_ptr": "*i64", "cu_ptr": "*i64"}
    signature |= {"target_ptr": "*fp32", "draft_ptr": "*fp32", "greedy_ptr": "*i32", "uniforms_ptr": "*fp32"}
    signature |= {"exp_ptr": "*fp32", "V": "i32", "out_stride": "i32", "BLOCK_V": "constexpr"}
    source = ASTSource(fn=_rejection_kernel, signature=signature, constexprs={"BLOCK_V": 1024})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    divisions = set(re.findall(r"\bdiv\.[a-z0-9.]*f32", ptx))
    assert divisions == {"div.rn.f32"}, divisions  # IEEE division, as torch's
    assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx  # no contraction, denormals kept


def test_the_interpreted_kernel_tests_really_ran():
    """Guards the delegation above against passing vacuously (e.g. a child that collected nothing)."""
    if _interpreter_active():
        return
    outcomes, log = _child_outcomes()
    expected = {
        "test_kernel_equals_reference_on_mixed_batches",
        "test_kernel_handles_a_batch_where_every_request_has_no_draft_or_is_greedy",
        "test_ties_across_vocab_tiles_go_to_the_lowest_token_id",
        "test_kernel_never_emits_a_token_outside_the_target_nucleus",
        "test_an_all_zero_residual_falls_back_to_the_target_with_the_same_tie_rule",
    }
    assert {name for name, outcome in outcomes.items() if outcome == "PASSED"} >= expected, log[-6000:]
