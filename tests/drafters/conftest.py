"""What the drafter tests share: the tiny random target whose embedding and LM head the drafters
share (`target`), and `with_random_norms` for tiny drafters whose every weight matters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.model.config import ModelConfig


@pytest.fixture(scope="module")
def target():
    """The tiny random target (fp32 linear layers), whose embedding / LM head the drafter shares."""
    from tests.conftest import build_transformer, random_hf_state_dict

    cfg = ModelConfig.tiny()
    return build_transformer(cfg, random_hf_state_dict(cfg, seed=0), compute_dtype=torch.float32)


def with_random_norms(drafter: nn.Module, *, seed: int) -> nn.Module:
    """`drafter` in eval mode with every norm weight drawn around 1 (they start at exactly 1, so a
    wrong or missing norm would not show otherwise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return drafter.eval()
