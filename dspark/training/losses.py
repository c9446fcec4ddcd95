"""DSpark's training objective (docs/method.md §3) as pure functions of tensors.

Per block, position k = 1..γ (anchor x_0 at absolute position t):
    x*_k   = the token at t + k (what block position k predicts)
    p_t_k  = the target's distribution at t + k, i.e. LMHead(final hidden at t + k - 1),
             computed here from the stored hidden state on the needed rows only (O(d) storage
             per token instead of O(V): `target_probs_from_hidden`)
    p_d_k  = softmax(U_k + B_k)  (draft logits, teacher forced)
    w_k    = exp(-(k-1)/γ_w)                                            (position weights)
    L_ce   = -Σ w_k log p_d_k(x*_k)                                     (Eq. L_ce)
    L_tv   =  Σ w_k ‖p_d_k - p_t_k‖₁                                    (Eq. L_tv; the full L1 norm = 2·TV)
    c*_k   = 1 - ½‖p_d_k - p_t_k‖₁   (analytic acceptance rate, detached)
    L_conf = -Σ w_k [c*_k log c_k + (1-c*_k) log(1-c_k)]                (Eq. L_conf)
    L      = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf
With a draft vocabulary D of N tokens (p_d = 0 outside D) the vocabulary-sized work runs over D
only: ‖p_d - p_t‖₁ = Σ_{v∈D} |p_d(v) - p_t(v)| + (1 - Σ_{v∈D} p_t(v)) (the target's mass outside
D, a constant of the drafter), and L_ce skips labels outside D (p_d(x*) = 0 there: they are
unreachable, as in EAGLE-3's draft-vocabulary training).
Normalisation (as DeepSpec): every Σ is a weighted MEAN over all blocks and positions,
Σ_{i,k} w_k m_ik ℓ_ik / Σ_{i,k} w_k m_ik, where m masks positions without a label (past the end
of the sequence, outside the response). Run the tests: python -m pytest tests/training -q
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def position_weights(block_size: int, *, decay: float, device: torch.device | str = "cpu") -> torch.Tensor:  # [γ]
    """w_k = exp(-(k-1)/γ_w) for k = 1..γ."""
    if block_size < 1 or not decay > 0:
        raise ValueError(f"need block_size >= 1 and decay > 0, got block_size={block_size}, decay={decay}")
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def label_positions(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # anchor_positions: [...] int64 -> [..., γ]: x*_k sits at t + k, k = 1..γ
    return anchor_positions.unsqueeze(-1) + torch.arange(1, block_size + 1, device=anchor_positions.device)


def target_hidden_positions(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # anchor_positions: [...] int64 -> [..., γ]: p_t_k comes from the target's output at t + k - 1
    return label_positions(anchor_positions, block_size) - 1


def target_probs_from_hidden(
    final_hidden: torch.Tensor,  # [n, hidden] target's final normed hidden states (LM head input)
    lm_head_weight: torch.Tensor,  # [V, hidden]
    *,
    temperature: float = 1.0,
) -> torch.Tensor:  # [n, V] fp32, rows sum to 1
    """p_t = softmax(h Wᵀ / T) on the given rows only (the production target cache stores h, not p)."""
    if final_hidden.dim() != 2 or lm_head_weight.dim() != 2 or final_hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"expected final_hidden [n, d] and lm_head_weight [V, d], got {list(final_hidden.shape)} and {list(lm_head_weight.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # The target distribution is the label, so it stays fp32 even inside a bf16 autocast region
    # (autocast would otherwise run this matmul in bf16 and move every p_t by ~1%).
    with torch.autocast(device_type=final_hidden.device.type, enabled=False):
        logits = final_hidden.float() @ lm_head_weight.float().t()  # [n, V]
        if temperature != 1.0:  # x / 1.0 == x: skip a pass over [n, V] in the common case
            logits = logits / temperature
        return torch.softmax(logits, dim=-1)


def target_probs_on_vocab(
    final_hidden: torch.Tensor,  # [n, hidden] the target's final normed hidden states
    lm_head_rows: torch.Tensor,  # [N, hidden] the LM head's rows of the draft vocabulary D
    lse: torch.Tensor,  # [n] log Σ_v exp(h·W_v) over the FULL vocabulary (the cache's logits_lse)
) -> tuple[torch.Tensor, torch.Tensor]:  # p_t on D [n, N] fp32, mass outside D [n] fp32
    """p_t restricted to D without the V-wide product: p_t(v) = exp(h·W_v - lse) for v in D, and
    the target's mass outside D, 1 - Σ_D p_t (clamped at 0: lse and the N products round apart by
    ~1e-7). Equal to softmax(h Wᵀ)[:, D] to fp32 rounding (tests/training/test_losses.py)."""
    with torch.autocast(device_type=final_hidden.device.type, enabled=False):
        p = torch.exp(final_hidden.float() @ lm_head_rows.float().t() - lse.float().unsqueeze(-1))  # [n, N]
    return p, (1.0 - p.sum(dim=-1)).clamp_min(0.0)


def weighted_mean(
    values: torch.Tensor,  # [n, γ] per-position loss terms
    weights: torch.Tensor,  # [γ] w_k
    mask: torch.Tensor | None = None,  # [n, γ] bool, True = has a label
) -> torch.Tensor:  # [] Σ w m v / Σ w m (0 when nothing is valid)
    w = weights.to(values.dtype).expand_as(values)
    if mask is not None:
        w = w * mask.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1e-12)


def acceptance_rate(
    draft_probs: torch.Tensor,  # [..., V] p_d
    target_probs: torch.Tensor,  # [..., V] p_t
) -> torch.Tensor:  # [...] c* = 1 - ½‖p_d - p_t‖₁ ∈ [0, 1]
    """The analytic acceptance probability of a draft from p_d under a target p_t (1 - TV)."""
    return (1.0 - 0.5 * (draft_probs - target_probs).abs().sum(dim=-1)).clamp(0.0, 1.0)


def ce_loss(
    draft_logits: torch.Tensor,  # [n, γ, V] U + B
    target_ids: torch.Tensor,  # [n, γ] int64 x*_k
    weights: torch.Tensor,  # [γ]
    mask: torch.Tensor | None = None,  # [n, γ] bool
) -> torch.Tensor:  # [] L_ce
    n, gamma, vocab = draft_logits.shape
    nll = F.cross_entropy(draft_logits.float().reshape(-1, vocab), target_ids.reshape(-1), reduction="none")
    return weighted_mean(nll.view(n, gamma), weights, mask)


def tv_loss(
    draft_probs: torch.Tensor,  # [n, γ, V] p_d
    target_probs: torch.Tensor,  # [n, γ, V] p_t
    weights: torch.Tensor,  # [γ]
    mask: torch.Tensor | None = None,  # [n, γ] bool
) -> torch.Tensor:  # [] L_tv = weighted mean of ‖p_d - p_t‖₁
    return weighted_mean((draft_probs - target_probs).abs().sum(dim=-1), weights, mask)


def confidence_loss(
    confidence_logits: torch.Tensor,  # [n, γ] raw logits of c_k
    c_star: torch.Tensor,  # [n, γ] labels in [0, 1]; detached here (no gradient into p_d)
    weights: torch.Tensor,  # [γ]
    mask: torch.Tensor | None = None,  # [n, γ] bool
) -> torch.Tensor:  # [] L_conf, BCE(σ(logit), c*) computed stably from the logit
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star.detach().float(), reduction="none")
    return weighted_mean(bce, weights, mask)


class _VocabTerms(torch.autograd.Function):
    """nll_k = -log p_d_k(x*_k) and l1_k = ‖p_d_k - p_t_k‖₁ of every row in one pass over [n, γ, V],
    with the gradient of any combination of them in closed form (softmax Jacobian J = diag(p) - p pᵀ):
        ∂nll/∂z = p_d - onehot(x*),     ∂l1/∂z = Jᵀ s = p_d ⊙ (s - ⟨s, p_d⟩),  s = sign(p_d - p_t)
    (sign(0) = 0, as autograd's abs). Same values as log_softmax / softmax / abs().sum() composed by
    autograd, to float rounding, but one fp32 copy of the logits instead of two, one softmax, and no
    autograd graph of half a dozen [n, γ, V] intermediates (a step is bound by these passes on CPU)."""

    @staticmethod
    def forward(ctx, draft_logits: torch.Tensor, target_probs: torch.Tensor, target_ids: torch.Tensor):
        # draft_logits: [n, γ, V] any float dtype; target_probs: [n, γ, V] fp32; target_ids: [n, γ] int64
        z = draft_logits.float()  # [n, γ, V] (the same tensor when already fp32: never written below)
        p = torch.softmax(z, dim=-1)  # [n, γ, V] p_d
        # log-sum-exp from the softmax's own pieces: p at the argmax is 1 / Σ exp(z - max) ≥ 1/V, so
        # lse = max - log p_max never sees an underflowed p (no second exp pass over [n, γ, V])
        z_max, arg = z.max(dim=-1, keepdim=True)  # [n, γ, 1]
        lse = z_max - p.gather(-1, arg).log()  # [n, γ, 1]
        nll = (lse - z.gather(-1, target_ids.clamp(min=0).unsqueeze(-1))).squeeze(-1)  # [n, γ] (-1: outside, masked by the caller)
        diff = p - target_probs  # [n, γ, V]
        l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1)  # [n, γ]
        ctx.save_for_backward(p, diff, target_ids)
        ctx.logits_dtype = draft_logits.dtype
        return nll, l1

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor, grad_l1: torch.Tensor):
        p, diff, target_ids = ctx.saved_tensors
        g_nll, g_l1 = grad_nll.unsqueeze(-1), grad_l1.unsqueeze(-1)  # [n, γ, 1]
        sp = torch.sign(diff).mul_(p)  # [n, γ, V] s ⊙ p
        dot = sp.sum(dim=-1, keepdim=True)  # [n, γ, 1] ⟨s, p⟩
        # g = g_l1 (s ⊙ p - p ⟨s, p⟩) + g_nll (p - onehot)
        grad = sp.mul_(g_l1).addcmul_(p, g_nll - g_l1 * dot)  # [n, γ, V]
        grad.scatter_add_(-1, target_ids.clamp(min=0).unsqueeze(-1), -g_nll * (target_ids >= 0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_loss_terms(
    draft_logits: torch.Tensor,  # [n, γ, V] U + B (any float dtype; computed in fp32)
    target_probs: torch.Tensor,  # [n, γ, V] p_t (no gradient)
    target_ids: torch.Tensor,  # [n, γ] int64 x*_k
) -> tuple[torch.Tensor, torch.Tensor]:  # nll [n, γ], l1 [n, γ] fp32 (differentiable in draft_logits)
    """Per position -log p_d(x*) and ‖p_d - p_t‖₁ (the summands of L_ce and L_tv, and c* = 1 - ½ l1),
    fused: equal to `ce_loss` / `tv_loss` before their weighted mean (tested)."""
    return _VocabTerms.apply(draft_logits, target_probs.detach().float(), target_ids)


@dataclass
class DSparkLoss:
    total: torch.Tensor  # [] L = ce_weight L_ce + tv_weight L_tv + conf_weight L_conf
    ce: torch.Tensor  # [] L_ce
    tv: torch.Tensor  # [] L_tv
    conf: torch.Tensor  # [] L_conf
    c_star: torch.Tensor  # [n, γ] detached analytic acceptance rates (diagnostics)


def dspark_loss(
    *,
    draft_logits: torch.Tensor,  # [n, γ, N] teacher-forced U + B (N = V, or the draft vocabulary)
    target_ids: torch.Tensor,  # [n, γ] int64 x*_k as indices into the N columns; -1 = outside the draft vocabulary
    target_probs: torch.Tensor,  # [n, γ, N] p_t on the same N columns (no gradient)
    confidence_logits: torch.Tensor,  # [n, γ]
    mask: torch.Tensor | None = None,  # [n, γ] bool, True = position has a label
    outside_mass: torch.Tensor | None = None,  # [n, γ] p_t's mass on the V - N tokens the drafter cannot propose
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    conf_weight: float = 1.0,
    position_decay: float = 4.0,  # γ_w
) -> DSparkLoss:
    n, gamma, vocab = draft_logits.shape
    if tuple(target_ids.shape) != (n, gamma) or tuple(confidence_logits.shape) != (n, gamma):
        raise ValueError(
            f"expected target_ids and confidence_logits [{n}, {gamma}], got {list(target_ids.shape)} and {list(confidence_logits.shape)}"
        )
    if tuple(target_probs.shape) != (n, gamma, vocab):
        raise ValueError(f"expected target_probs [{n}, {gamma}, {vocab}], got {list(target_probs.shape)}")
    if mask is not None and tuple(mask.shape) != (n, gamma):
        raise ValueError(f"expected mask [{n}, {gamma}], got {list(mask.shape)}")
    weights = position_weights(gamma, decay=position_decay, device=draft_logits.device)
    # one fused pass over the vocabulary (the plain composition is ce_loss, tv_loss, acceptance_rate)
    nll, l1 = vocab_loss_terms(draft_logits, target_probs, target_ids)  # [n, γ] each
    if outside_mass is not None:
        l1 = l1 + outside_mass.detach().float()  # |0 - p_t(v)| summed over v ∉ D
    c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # [n, γ] acceptance_rate of p_d, p_t
    in_vocab = target_ids >= 0  # [n, γ]
    ce = weighted_mean(nll, weights, in_vocab if mask is None else mask & in_vocab)
    tv = weighted_mean(l1, weights, mask)
    conf = confidence_loss(confidence_logits, c_star, weights, mask)
    total = ce_weight * ce + tv_weight * tv + conf_weight * conf
    return DSparkLoss(total=total, ce=ce, tv=tv, conf=conf, c_star=c_star)


@torch.no_grad()
def expected_acceptance(
    c_star: torch.Tensor,  # [n, γ]
    mask: torch.Tensor | None = None,  # [n, γ] bool
) -> torch.Tensor:  # [γ] mean c*_k per position over blocks with a label there (nan if none)
    m = torch.ones_like(c_star) if mask is None else mask.to(c_star.dtype)
    return (c_star * m).sum(0) / m.sum(0)


@torch.no_grad()
def greedy_acceptance(
    draft_argmax: torch.Tensor,  # [n, γ] int64 argmax of p_d_k (target ids), teacher forced
    target_argmax: torch.Tensor,  # [n, γ] int64 argmax of p_t_k
    mask: torch.Tensor | None = None,  # [n, γ] bool, a prefix per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tau [], hits [γ], tries [γ]
    """Acceptance at temperature 0: draft k survives iff it equals the target's argmax and every
    earlier one did. tau = mean over blocks of 1 + (leading matches), bonus included; hits_k /
    tries_k is the conditional acceptance at k (tries_k: blocks whose drafts 1..k-1 all survived
    and that have a label at k). Teacher forced along the data's tokens, which for greedy
    regenerations ARE the target's argmax chain: then this is the served greedy acceptance."""
    m = torch.ones_like(draft_argmax, dtype=torch.bool) if mask is None else mask
    run = ((draft_argmax == target_argmax) & m).long().cumprod(dim=-1)  # [n, γ] 1 while all matched
    reached = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], dim=-1) * m.long()  # [n, γ]
    tau = (1.0 + run.sum(-1).double()).mean()
    return tau, run.sum(0), reached.sum(0)


@torch.no_grad()
def expected_accepted_length(
    c_star: torch.Tensor,  # [n, γ]
    mask: torch.Tensor | None = None,  # [n, γ] bool, a prefix per row
) -> torch.Tensor:  # [] mean over blocks of τ = 1 + Σ_k Π_{i≤k} c*_i (bonus token included)
    c = c_star if mask is None else c_star * mask.to(c_star.dtype)
    return (1.0 + c.cumprod(dim=-1).sum(dim=-1)).mean()


__all__ = [
    "DSparkLoss", "acceptance_rate", "ce_loss", "confidence_loss", "dspark_loss", "expected_acceptance",
    "expected_accepted_length", "greedy_acceptance", "label_positions", "position_weights", "target_hidden_positions",
    "target_probs_from_hidden", "target_probs_on_vocab", "tv_loss", "vocab_loss_terms", "weighted_mean",
]
