"""The DSpark drafter (docs/method.md §2): parallel backbone + sequential Markov/RNN head + confidence head.

    config.py      DSparkConfig (flat, frozen, JSON round trip, `from_target`, `tiny`)
    model.py       DSparkDrafter, BlockBatch / DraftBlock, the leakage-rule attention mask
    heads.py       MarkovHead, RNNHead, ConfidenceHead, sample_sequential (exact draft rows)
    checkpoint.py  save_checkpoint / load_checkpoint (safetensors + JSON, never pickle)
    serving.py     DSparkServingDrafter: the engine's Drafter (context K/V cache per request)
    objective.py   DSparkObjective: `dspark train --algo dspark` (the losses of dspark.training.losses)
    family.py      its entry in the drafter registry (dspark/drafters/registry.py)

STS calibration lives in dspark.calibration.sts.
Tests: python -m pytest tests/drafters/test_dspark_model.py -q
"""

from __future__ import annotations

from dspark.drafters.dspark.checkpoint import (
    DrafterCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.heads import (
    ConfidenceHead,
    DraftSample,
    MarkovHead,
    RNNHead,
    sample_sequential,
)
from dspark.drafters.dspark.model import (
    BlockBatch,
    DraftBlock,
    DSparkDrafter,
    TeacherForcedOutput,
    block_attention_mask,
)

__all__ = [
    "BlockBatch", "ConfidenceHead", "DSparkConfig", "DSparkDrafter", "DraftBlock", "DraftSample",
    "DrafterCheckpoint", "MarkovHead", "RNNHead", "TeacherForcedOutput",
    "block_attention_mask", "load_checkpoint", "sample_sequential", "save_checkpoint",
]
