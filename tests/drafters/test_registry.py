"""Specification of the drafter registry (dspark/drafters/registry.py): every name it serves
builds a drafter whose spec is complete and agrees with its checkpoint, and a new family is one
`DrafterFamily` entry: registered from this file alone, it is trained by the trainer, served by
`make_drafter` and drafts in the engine, with no other module edited.

    python -m pytest tests/drafters/test_registry.py -q
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from dspark.drafters import registry
from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest, checked_spec
from dspark.drafters.checkpoint_io import load_weights, read_config_json, save_weights
from dspark.drafters.registry import DrafterFamily, drafter_capture_layers, drafter_names, make_drafter
from dspark.drafters.shared import SharedWeights, draw_tokens, to_proposal
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from dspark.training.anchors import TrainBatch
from dspark.training.losses import ce_loss, position_weights
from dspark.training.objective import DIAGNOSTIC_DECAY, StepLoss, acceptance_metrics, refuse_dspark_options
from dspark.training.trainer import TrainConfig, read_metrics, train
from tests.conftest import make_tiny_runtime
from tests.drafters import test_dflash_serving, test_dspark_serving, test_eagle3_serving
from tests.training.test_target_cache import CAPTURE, make_tiny_cache

GREEDY = SamplingParams(temperature=0.0)


# ---- every registered drafter -------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime():
    return make_tiny_runtime(capture_layers=CAPTURE, compute_dtype=torch.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, runtime) -> dict[str, Path]:
    """A tiny random checkpoint of every built-in family (block size 4), saved by its registry entry."""
    models = {"dspark": test_dspark_serving.make_serving_drafter(runtime).model,
              "dflash": test_dflash_serving.make_serving_drafter(runtime).model,
              "eagle3": test_eagle3_serving.make_serving_drafter(runtime).model}
    assert set(models) == {f.name for f in registry.families()}  # a new built-in family gets a checkpoint here
    paths = {}
    for name, model in models.items():
        paths[name] = tmp_path_factory.mktemp(name)
        registry.family(name).save(paths[name], drafter=model)
    return paths


@pytest.mark.parametrize("name", drafter_names())
def test_every_registered_drafter_declares_a_complete_spec(name, runtime, checkpoints):
    family = registry.checkpoint_family(name)
    path = checkpoints.get(family)
    drafter = make_drafter(name, runtime=runtime, path=path)
    if name == "none":
        assert drafter is None  # plain decoding: the engine's NoDrafter
        return
    spec = checked_spec(drafter)
    assert spec.name == name
    layers = drafter_capture_layers(name, path)
    assert spec.capture_layers == (layers or ())  # what the runtime is loaded to capture is what it reads
    assert spec.needs_hidden_states == (layers is not None)
    assert spec.free_proposals == name.endswith(registry.LOOKUP_SUFFIX)  # only the lookups' suffix searches are free
    if path is None:
        assert spec.block_size is None and not spec.provides_confidences  # n-gram: no trained block, no confidences
    else:
        assert spec.block_size == registry.family(family).config.from_json((path / "config.json").read_text()).block_size == 4
        assert spec.provides_confidences == registry.family(family).lookup_variant  # a lookup needs the model's confidences


def test_every_family_loads_what_it_saves(runtime, checkpoints):
    shared = SharedWeights.from_target(runtime.model)
    for family in registry.families():
        model = family.load(checkpoints[family.name], shared=shared)
        assert isinstance(model, family.model) and model.config.target_layer_ids == CAPTURE


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown drafter 'eagle4'; expected one of \('none', 'ngram', 'dspark'"):
        make_drafter("eagle4")
    with pytest.raises(ValueError, match="unknown drafter family 'eagle4'"):
        registry.family("eagle4")
    with pytest.raises(ValueError, match="taken or reserved"):
        registry.register_family(registry.family("dflash"))


# ---- a fourth family, from this file alone ------------------------------------------------------
# A unigram drafter: one learned distribution over the vocabulary, drawn from iid at every draft
# position. It declares that it reads the target's hidden states (it only counts them), so the
# engine's hand-over of features is exercised through the contract too.


@dataclass(frozen=True)
class UnigramConfig:
    vocab_size: int
    hidden_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int

    def to_json(self) -> str:
        return json.dumps({"algo": "unigram", **dataclasses.asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> UnigramConfig:
        d = json.loads(text)
        d.pop("algo")
        return cls(**{**d, "target_layer_ids": tuple(d["target_layer_ids"])})


class UnigramDrafter(nn.Module):
    def __init__(self, config: UnigramConfig, *, shared: SharedWeights):
        super().__init__()
        self.config = config
        self.logits = nn.Parameter(torch.zeros(config.vocab_size))  # [V]
        self.shared = shared  # the target's LM head: the diagnostics' p_t


def save_unigram(directory: str | Path, *, drafter: UnigramDrafter) -> Path:
    return save_weights(directory, module=drafter, config_json=drafter.config.to_json(), fmt="unigram-drafter/1")


def load_unigram(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> UnigramDrafter:
    drafter = UnigramDrafter(UnigramConfig.from_json(read_config_json(directory, algo="unigram")), shared=shared)
    load_weights(directory, module=drafter, fmt="unigram-drafter/1", device=device)
    return drafter


class UnigramServingDrafter(Drafter):
    def __init__(self, model: UnigramDrafter):
        self.model = model
        self.observed: dict[str, int] = {}  # request -> verified positions whose features were handed over

    @property
    def spec(self) -> DrafterSpec:
        c = self.model.config
        return DrafterSpec(name="unigram", needs_hidden_states=True, capture_layers=c.target_layer_ids, block_size=c.block_size)

    @classmethod
    def load(cls, path: str | Path, *, target, top_k: int = 0) -> UnigramServingDrafter:
        return cls(load_unigram(path, shared=SharedWeights.from_target(target)))

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        assert features.shape[1:] == (len(self.model.config.target_layer_ids), self.model.config.hidden_size)
        self.observed[request_id] = self.observed.get(request_id, 0) + features.shape[0]

    def context_len(self, request_id: str) -> int:
        return self.observed.get(request_id, 0)

    def remove_request(self, request_id: str) -> None:
        self.observed.pop(request_id, None)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = []
        for r in requests:
            assert self.context_len(r.request_id) == len(r.token_ids) - 1  # the engine observed every verified position
            if r.max_draft_tokens == 0:
                out.append(DraftProposal.empty())
                continue
            rows = self.model.logits.expand(r.max_draft_tokens, -1)  # [k, V]
            tokens, probs = draw_tokens(rows, temperature=r.params.temperature, generator=r.generator)
            out.append(to_proposal(tokens, probs, truncated=False))
        return out


class UnigramObjective:
    default_layers = 1

    def check(self, config: TrainConfig) -> None:
        refuse_dspark_options(config)

    def build(self, *, config, target_config, cache, shared: SharedWeights) -> UnigramDrafter:
        return UnigramDrafter(UnigramConfig(vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
                                            target_layer_ids=tuple(cache.capture_layers), block_size=config.block_size),
                              shared=shared)

    def loss(self, model: UnigramDrafter, batch: TrainBatch) -> StepLoss:
        valid = batch.blocks.block_valid
        labels, mask = batch.target_tokens[valid], batch.label_mask[valid]  # [n, γ] each
        logits = model.logits.expand(*labels.shape, -1)  # [n, γ, V]
        ce = ce_loss(logits, labels, position_weights(labels.shape[1], decay=DIAGNOSTIC_DECAY), mask)
        metrics = {"loss": ce.item(), **acceptance_metrics(logits.detach(), batch, model.shared.lm_head, decay=DIAGNOSTIC_DECAY)}
        return StepLoss(total=ce, metrics=metrics)


UNIGRAM = DrafterFamily(name="unigram", config=UnigramConfig, model=UnigramDrafter, load=load_unigram, save=save_unigram,
                        serving=UnigramServingDrafter, objective=UnigramObjective())


@pytest.fixture
def unigram_registered():
    registry.register_family(UNIGRAM)
    yield UNIGRAM
    registry.unregister_family(UNIGRAM.name)


def test_a_fourth_family_is_one_registry_entry_trained_and_served_by_name(unigram_registered, runtime, tmp_path):
    assert "unigram" in drafter_names() and "unigram-lookup" not in drafter_names()  # no confidences: no lookup variant
    # trained by the trainer, which reads the registry (the cache's target is `runtime`'s: seed 0)
    cache = make_tiny_cache(tmp_path)
    config = TrainConfig(algo="unigram", steps=3, batch_seqs=3, anchors_per_seq=8, lr=0.1, layers=1, block_size=3,
                         checkpoint_every=3)
    result = train(config, cache=cache, target_config=runtime.config, shared=SharedWeights.from_target(runtime.model),
                   run_dir=tmp_path / "run", progress=False)
    losses = [e["loss"] for e in read_metrics(tmp_path / "run") if "step" in e]
    assert len(losses) == 3 and losses[-1] < losses[0] and result.summary["heldout"]["tau"] >= 1.0
    # served by name from its checkpoint, as `--drafter unigram --drafter-path DIR`
    assert drafter_capture_layers("unigram", result.final_dir) == CAPTURE
    drafter = make_drafter("unigram", runtime=runtime, path=result.final_dir)
    assert isinstance(drafter, UnigramServingDrafter) and drafter.spec.block_size == 3
    # and lossless in the engine: greedy output is plain greedy decoding, with drafts made
    prompts = [[5, 6, 7, 8] * 3, [1, 2, 3]]
    plain = SpeculativeEngine(runtime, None).generate([GenerationRequest(f"p{i}", p, 12, GREEDY) for i, p in enumerate(prompts)])
    spec = SpeculativeEngine(runtime, drafter, num_speculative_tokens=3).generate(
        [GenerationRequest(f"s{i}", p, 12, GREEDY) for i, p in enumerate(prompts)])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert sum(s.draft_tokens for s in spec) > 0 and drafter.observed == {}  # drafted, then every request freed
