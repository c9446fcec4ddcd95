"""The DFlash drafter behind the engine's `Drafter` contract (serving mode).

The per-request context cache is DSpark's (`DSparkServingDrafter`: every draft layer's
context keys/values of the verified positions, projected once in `observe`), since the
backbone is the same. A round: one parallel backbone forward over all requests' blocks
[x_0, mask × γ]; each request then draws its x_1..x_γ independently from the γ mask
positions' own softmaxes, with its own generator and temperature (argmax at T = 0), and the
proposal carries those very rows. No confidences: DFlash has no confidence head, so the
draft-length policies that need them (threshold, dspark) refuse it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.base import DrafterSpec, DraftProposal, DraftRequest
from dspark.drafters.dflash.checkpoint import load_checkpoint
from dspark.drafters.dflash.model import DFlashDrafter
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.shared import SharedWeights, draw_tokens, is_truncated, to_proposal
from dspark.model.transformer import Transformer


class DFlashServingDrafter(DSparkServingDrafter):
    def __init__(
        self,
        model: DFlashDrafter,
        *,
        top_k: int = 0,  # truncate the drafter's rows (sparse on the wire); 0 = full softmax
        top_p: float = 1.0,
        logits_fn=None,  # hidden [n, d] -> U [n, V]: the target's packed LM head; None = the model's own matmul
    ):
        super().__init__(model, temperatures=None, top_k=top_k, top_p=top_p, logits_fn=logits_fn)

    @property
    def spec(self) -> DrafterSpec:
        c = self.model.config
        return DrafterSpec(name="dflash", needs_hidden_states=True, capture_layers=c.target_layer_ids, block_size=c.block_size)

    @classmethod
    def load(cls, path: str | Path, *, target: Transformer, top_k: int = 0, top_p: float = 1.0) -> DFlashServingDrafter:
        model = load_checkpoint(path, shared=SharedWeights.from_target(target), device=target.embed.weight.device)
        model.config.check_target(target.config)
        return cls(model, top_k=top_k, top_p=top_p, logits_fn=target.compute_logits)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = [DraftProposal.empty() for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_draft_tokens > 0]
        if not active:
            return out
        steps = max(requests[i].max_draft_tokens for i in active)  # the LM head runs only as far as some request drafts
        # 1: the masks (the anchor's own output predicts nothing); 0 with anchor_predicts (DeepSpec's block)
        first = self.model.config.first_draft_slot
        hidden = self._encode_blocks(requests, active)[:, first : first + steps]  # [n, steps, hidden]
        logits = self._base_logits(hidden)  # [n, steps, V]
        vocab = logits.shape[-1]
        for row, i in enumerate(active):
            req = requests[i]
            k = req.max_draft_tokens
            temperature = req.params.temperature
            tokens, probs = draw_tokens(logits[row, :k], temperature=temperature, top_k=self.top_k, top_p=self.top_p,
                                        generator=self._generator(req))
            tokens, probs = tokens.cpu(), None if probs is None else probs.cpu()  # host data for the engine (no copy on the CPU)
            truncated = is_truncated(temperature=temperature, top_k=self.top_k, top_p=self.top_p, vocab_size=vocab)
            out[i] = to_proposal(tokens, probs, truncated=truncated)
        return out


__all__ = ["DFlashServingDrafter"]
