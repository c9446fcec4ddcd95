"""The DSpark drafter behind the engine's `Drafter` contract (serving mode).

Per request it keeps a context-feature cache: the target's captured layer outputs for every
position the target has verified (prompt + accepted tokens). The engine appends to it after
each forward (`observe`), so at a round's start the cache holds positions 0..t-1 and the anchor
x_0 sits at position t: exactly the leakage rule the drafter was trained under.

A round: one parallel backbone forward over all requests' blocks, then the sequential head
samples each request's x_1..x_γ left to right with that request's own generator (so a seeded
request reproduces whatever else is in the batch), at the request's temperature (greedy
requests get a point mass on the argmax). Proposals carry the exact rows sampled from and the
STS-calibrated conditional confidences c_k = σ(l_k / T_k).

The cache holds raw target features; the projected per-layer context K/V are recomputed each
round (a cache of those is the next optimisation).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.calibration.sts import apply_temperatures
from dspark.drafters.base import DraftProposal, DraftRequest
from dspark.drafters.dspark.checkpoint import load_checkpoint
from dspark.drafters.dspark.heads import sample_sequential
from dspark.drafters.dspark.model import BlockBatch, DraftBlock, DSparkDrafter, SharedWeights
from dspark.model.transformer import Transformer


class DSparkServingDrafter:
    name = "dspark"
    needs_hidden_states = True  # the engine captures target layer outputs and calls observe()
    provides_confidences = True  # STS-calibrated c_k with every proposal (the prefix scheduler's input)

    def __init__(
        self,
        model: DSparkDrafter,
        *,
        temperatures: torch.Tensor | None = None,  # [γ] STS temperatures; None = uncalibrated
        top_k: int = 0,  # truncate the drafter's rows (sparse on the wire); 0 = full softmax
        top_p: float = 1.0,
        logits_fn=None,  # hidden [n, d] -> U [n, V]: the target's packed LM head; None = the model's own matmul
    ):
        self.model = model.eval()
        self.logits_fn = logits_fn
        self.temperatures = temperatures
        self.top_k, self.top_p = top_k, top_p
        self.block_size = model.config.block_size
        self.capture_layers = tuple(model.config.target_layer_ids)
        self._features: dict[str, torch.Tensor] = {}  # request -> [capacity, m, hidden]
        self._lengths: dict[str, int] = {}

    @classmethod
    def load(cls, path: str | Path, *, target: Transformer, top_k: int = 0, top_p: float = 1.0) -> "DSparkServingDrafter":
        ckpt = load_checkpoint(path, shared=SharedWeights.from_target(target))
        ckpt.drafter.config.check_target(target.config)
        # The shared LM head through the target's prepacked GEMM: 4x faster than a plain fp32
        # matmul for γ rows here, and it is the same weight.
        return cls(ckpt.drafter, temperatures=ckpt.temperatures, top_k=top_k, top_p=top_p, logits_fn=target.compute_logits)

    # ---- the context-feature cache ---------------------------------------------------------

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        """Append the target's captured layer outputs of newly verified positions.
        features: [num_new, m, hidden], in position order."""
        n = features.shape[0]
        length = self._lengths.get(request_id, 0)
        buf = self._features.get(request_id)
        if buf is None or length + n > buf.shape[0]:
            grown = torch.empty(max(2 * (length + n), 64), *features.shape[1:], dtype=torch.float32)
            if buf is not None:
                grown[:length] = buf[:length]
            self._features[request_id] = buf = grown
        buf[length : length + n] = features
        self._lengths[request_id] = length + n

    def remove_request(self, request_id: str) -> None:
        self._features.pop(request_id, None)
        self._lengths.pop(request_id, None)

    def context_len(self, request_id: str) -> int:
        return self._lengths.get(request_id, 0)

    # ---- one round -------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = [DraftProposal.empty() for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_draft_tokens > 0]
        if not active:
            return out
        blocks = []
        for i in active:
            req = requests[i]
            t = len(req.token_ids) - 1  # the anchor's position
            if self._lengths.get(req.request_id) != t:
                raise RuntimeError(
                    f"request {req.request_id!r}: the drafter has features of {self._lengths.get(req.request_id, 0)} "
                    f"positions, the anchor sits at {t}; the engine must observe() every verified position"
                )
            ctx = self._features[req.request_id][:t]  # [t, m, hidden]
            blocks.append(DraftBlock(context=ctx, anchor_position=t, anchor_token=req.token_ids[-1]))
        hidden = self.model.encode(BlockBatch.from_blocks(blocks))[:, 0]  # [n, γ, hidden]
        if self.logits_fn is not None:
            base_logits = self.logits_fn(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1)  # [n, γ, V]
        else:
            base_logits = self.model.base_logits(hidden)  # [n, γ, V]
        for row, i in enumerate(active):
            req = requests[i]
            sample = sample_sequential(
                base_logits=base_logits[row : row + 1],
                hidden=hidden[row : row + 1],
                anchor_tokens=torch.tensor([req.token_ids[-1]]),
                head=self.model.head,
                confidence_head=self.model.confidence_head,
                temperature=req.params.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                generator=req.generator,
            )
            logits = sample.confidence_logits[0]  # [γ]
            conf = apply_temperatures(logits, self.temperatures) if self.temperatures is not None else torch.sigmoid(logits)
            out[i] = sample.proposal(0, num_tokens=req.max_draft_tokens, confidences=conf)
        return out
