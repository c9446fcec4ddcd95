"""The DFlash drafter: DSpark's parallel backbone in its original form, no heads.

One block (anchor x_0 at absolute position t, γ = block_size):
  * block input   [embed(x_0), embed(mask) × γ] at positions t, t+1, ..., t+γ (γ + 1 inputs);
  * every draft layer: the KV-injected, bidirectional-in-block attention of
    `dspark.drafters.dspark.model.ParallelBackbone` (context positions < t only);
  * output        the mask at position t + k (k = 1..γ) predicts the token at t + k:
                  p_k = softmax(LMHead(h_k)), each position independently; the anchor's own
                  output predicts nothing.
(`DFlashConfig.anchor_predicts`: DeepSpec's DFlash instead feeds [x_0, mask × (γ-1)] and reads
all γ outputs, the anchor's predicting x_1, exactly DSpark's block without its heads.)
So DFlash spends one more block position than DSpark (which predicts from the anchor position
itself) and has no sequential or confidence head: x_k's distribution cannot react to the x_<k
actually drawn in the round. Training (dspark train --algo dflash) is cross-entropy with
position weights; serving (serving.py) is one parallel forward per round.
"""

from __future__ import annotations

import torch

from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dspark.model import BlockBatch, ParallelBackbone
from dspark.drafters.shared import SharedWeights


class DFlashDrafter(ParallelBackbone):
    """Trainable: W_c + context norm, the draft layers, the final norm (all of the backbone).
    Referenced, frozen: the target's embedding and LM head (`shared`)."""

    def __init__(self, config: DFlashConfig, *, shared: SharedWeights):
        super().__init__(config, shared=shared, block_len=config.block_len)

    def mask_hidden(self, batch: BlockBatch) -> torch.Tensor:
        """h_1..h_γ, the outputs predicting x_1..x_γ [rows, blocks_per_row, γ, hidden]: the mask
        positions (the anchor's dropped), or the whole block with `anchor_predicts`."""
        first = self.config.first_draft_slot
        return self.encode(batch)[:, :, first : first + self.config.block_size]

    def forward(self, batch: BlockBatch) -> torch.Tensor:  # [rows, blocks_per_row, γ, V] fp32
        """Training: logits of x_1..x_γ for every block (padding blocks included; mask them)."""
        return self.base_logits(self.mask_hidden(batch))


__all__ = ["DFlashDrafter"]
