"""Golden vectors for loading DeepSpec checkpoints, made WITH DeepSpec's own code.

    git -C /work/.mirror/deepseek-ai+DeepSpec/repo archive HEAD deepspec config LICENSE | tar -x -C /tmp/deepspec
    .venv/bin/python scripts/make_deepspec_fixtures.py --deepspec /tmp/deepspec [--out tests/fixtures/deepspec]

(archive only those paths: some large eval_datasets blobs are absent from the mirror.)

For each fixture this script
  1. builds a tiny random Qwen3 target config (transformers' Qwen3Config) and, from it, the draft
     config with DeepSpec's own `build_draft_config` (dspark / eagle3 qwen3 config.py), exactly as
     its trainers do;
  2. instantiates DeepSpec's model class (Qwen3DSparkModel / Qwen3Eagle3Model), re-draws every
     weight at a scale where each one matters (norms around 1, not exactly 1; W2 of the Markov
     head non-zero), and writes it with `save_pretrained` in bf16: the layout DeepSpec's
     ckpt_manager releases (config.json + model.safetensors, embed_tokens / lm_head included);
  3. reloads that directory with `from_pretrained(dtype=float32, attn_implementation="sdpa")`, as
     DeepSpec's evaluators do (in fp32 here rather than bf16, so that the goldens are
     reproducible to ~1e-5), and runs DeepSpec's own eval-time draft path on fixed inputs:
       - DSpark / DFlash: deepspec.eval.dspark.draft_ops.forward_dspark_draft_block, then the
         model's compute_logits + sample_draft_tokens (greedy) and build_dspark_proposal for the
         tokens and confidence logits (confidence_threshold 0: the whole block);
       - EAGLE-3: the steps of Qwen3Eagle3Evaluator._init_context / _propose (extend_draft_cache
         over the prompt features paired with the next tokens, then one forward per draft step).
  4. saves expected.safetensors next to the checkpoint: the inputs (target layer outputs
     `context` [L, m, hidden] fp32, `token_ids` [S], `anchor_positions` [A]) and the outputs
     (`draft_tokens` [A, γ], `draft_logits` [A, γ, V] fp32, `confidence_logits` [A, γ] for DSpark).

Nothing of DeepSpec is copied into the package: this script imports it from the checkout given.
No CUDA shims are needed: DeepSpec's eval path uses SDPA (flex_attention / torch.compile /
triton are only on its training path, which this script does not touch). One shim for the
installed transformers: DeepSpec pins transformers 5.10.2, whose `DynamicCache.crop(n)` keeps the
first n positions; newer releases refuse a positive n (`CropCompatCache`, used only after the
draft forward, to drop the block from a cache this script then discards).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec"
CONTEXT_LEN = 12  # L: target positions whose layer outputs are known (the context)
ANCHORS = (5, 12)  # t: the anchor's position; the drafter reads context positions < t


def crop_compat_cache():
    """A DynamicCache whose crop(n) keeps the first n positions, as in DeepSpec's pinned transformers."""
    from transformers import DynamicCache

    class CropCompatCache(DynamicCache):
        def crop(self, max_length: int) -> None:
            remove = self.get_seq_length() - max_length
            if max_length >= 0 and remove > 0:
                super().crop(-remove)
            elif max_length < 0:
                super().crop(max_length)

    return CropCompatCache()


class Args(dict):
    """DeepSpec reads model args as `args.field` and `"field" in args` (its ConfigDict)."""

    __getattr__ = dict.__getitem__


def target_config(*, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=False,
    )


BIG = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64, layers=6)  # the three released kinds
SMALL = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32, layers=4)  # head variants (size budget)

FIXTURES = {
    # DSpark as released (config/dspark/*.py): vanilla Markov head, confidence head reading W1[x_{k-1}]
    "dspark_qwen3_tiny_block7": dict(kind="dspark", target=BIG, args=dict(
        block_size=7, num_draft_layers=2, target_layer_ids=[1, 3], mask_token_id=250, num_anchors=8,
        markov_rank=16, markov_head_type="vanilla", confidence_head_alpha=1.0, confidence_head_with_markov=True)),
    # DFlash as released (config/dflash/*.py): DSpark's model with no Markov and no confidence head
    "dflash_qwen3_tiny_block4": dict(kind="dspark", target=BIG, args=dict(
        block_size=4, num_draft_layers=1, target_layer_ids=[1, 3], mask_token_id=250, num_anchors=8,
        markov_rank=0, confidence_head_alpha=0.0)),
    # EAGLE-3 as released (config/eagle3/*.py): one layer, exactly 5 target layers, TTT length γ
    "eagle3_qwen3_tiny_ttt4": dict(kind="eagle3", target=BIG, args=dict(
        target_model_name_or_path="tiny-qwen3", target_layer_ids=[0, 1, 2, 3, 4], ttt_length=4,
        step_loss_decay=0.8, draft_num_hidden_layers=1)),
    # the other head forms DeepSpec's code supports
    "dspark_qwen3_tiny_rnn_block4": dict(kind="dspark", target=SMALL, args=dict(
        block_size=4, num_draft_layers=1, target_layer_ids=[0, 2], mask_token_id=250, num_anchors=8,
        markov_rank=8, markov_head_type="rnn", confidence_head_alpha=1.0, confidence_head_with_markov=True)),
    "dspark_qwen3_tiny_gated_block4": dict(kind="dspark", target=SMALL, args=dict(
        block_size=4, num_draft_layers=1, target_layer_ids=[0, 2], mask_token_id=250, num_anchors=8,
        markov_rank=8, markov_head_type="gated", confidence_head_alpha=1.0, confidence_head_with_markov=False)),
}


@torch.no_grad()
def randomize(model: torch.nn.Module, *, seed: int) -> None:
    """Every weight at a scale where it matters: linear W ~ N(0, 1/fan_in), biases ~ N(0, 0.1),
    norms ~ 1 + N(0, 0.1), embedding / LM head rows ~ N(0, 0.3²) (logits of std ~2), W1 ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        elif "markov_w1" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def build(kind: str, tcfg, args: dict):
    if kind == "dspark":
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config

        return Qwen3DSparkModel(build_draft_config(tcfg, Args(args)))
    from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model, build_draft_config

    return Qwen3Eagle3Model(build_draft_config(target_config=tcfg, model_args=Args(args)))


def reload(kind: str, directory: Path):
    # as DeepSpec's evaluators load a draft (Qwen3DSparkEvaluator / Qwen3Eagle3Evaluator.build_models), in fp32
    if kind == "dspark":
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel as cls
    else:
        from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model as cls
    return cls.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.no_grad()
def dspark_goldens(model, context: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """DeepSpec's eval draft step (Qwen3DSparkEvaluator._propose) at each anchor, greedy."""
    from deepspec.eval.dspark.draft_ops import build_dspark_proposal, forward_dspark_draft_block

    gamma = int(model.block_size)
    tokens, logits, conf = [], [], []
    for t in ANCHORS:
        draft_input_ids = torch.full((1, gamma), int(model.mask_token_id), dtype=torch.long)  # [1, γ]
        draft_input_ids[:, 0] = token_ids[t]
        position_ids = torch.arange(t + gamma + 1).unsqueeze(0)  # [1, positions]
        block_hidden = forward_dspark_draft_block(
            model, draft_input_ids=draft_input_ids, position_ids=position_ids, past_key_values_draft=crop_compat_cache(),
            target_hidden_states=context[:t].flatten(1).unsqueeze(0),  # [1, t, m * hidden]: layer-major concat
            start=t, block_size=gamma,
        )  # [1, γ, hidden]
        proposal = build_dspark_proposal(model, draft_input_ids=draft_input_ids, block_hidden=block_hidden,
                                         block_size=gamma, temperature=0.0, confidence_threshold=0.0)
        # the logits build_dspark_proposal sampled from (it returns only their point masses at T = 0)
        hidden = block_hidden[:, :gamma, :]
        sampled, corrected = model.sample_draft_tokens(model.compute_logits(hidden), first_prev_token_ids=draft_input_ids[:, 0],
                                                       temperature=0.0, hidden_states=hidden)
        assert torch.equal(sampled[0], proposal.verify_input_ids[0, 1:])
        tokens.append(sampled[0])
        logits.append(corrected[0].float())
        if proposal.confidence_logits is not None:
            conf.append(proposal.confidence_logits[0].float())
    out = {"draft_tokens": torch.stack(tokens), "draft_logits": torch.stack(logits)}
    if conf:
        out["confidence_logits"] = torch.stack(conf)
    return out


@torch.no_grad()
def eagle3_goldens(model, context: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Qwen3Eagle3Evaluator._init_context (prompt = positions 0..t-1, its bonus token = the anchor
    x_t) then _propose (γ greedy steps), on DeepSpec's model."""
    from transformers import DynamicCache

    gamma = int(model.ttt_length)
    tokens, logits = [], []
    for t in ANCHORS:
        position_ids = torch.arange(t + gamma + 1).unsqueeze(0)  # [1, positions]
        cache = DynamicCache()
        # training pairs target hidden state i with token i + 1 at RoPE position i (their comment)
        hidden = model.extend_draft_cache(hidden_states=context[:t].flatten(1).unsqueeze(0),  # [1, t, m * hidden]
                                          input_ids=token_ids[1 : t + 1].unsqueeze(0), position_ids=position_ids[:, :t],
                                          past_key_values=cache)  # [1, 1, hidden]
        step_tokens, step_logits, next_position = [], [], t
        for _ in range(gamma):
            lg = model.compute_logits(hidden)  # [1, 1, V]
            step_logits.append(lg[0, -1].float())
            nxt = lg.argmax(dim=-1)  # [1, 1] (deepspec.utils.sampling.sample_tokens at T = 0)
            step_tokens.append(nxt[0, -1])
            hidden = model(hidden_states=hidden, input_ids=nxt[:, -1:],
                           position_ids=position_ids[:, next_position : next_position + 1], past_key_values=cache, use_cache=True)
            next_position += 1
        tokens.append(torch.stack(step_tokens))
        logits.append(torch.stack(step_logits))
    return {"draft_tokens": torch.stack(tokens), "draft_logits": torch.stack(logits)}


def make(name: str, spec: dict, out: Path, seed: int) -> None:
    kind = spec["kind"]
    tcfg = target_config(**spec["target"])
    model = build(kind, tcfg, spec["args"])
    randomize(model, seed=seed)
    directory = out / name
    if directory.exists():
        shutil.rmtree(directory)
    model.to(torch.bfloat16).save_pretrained(str(directory))  # the released layout (ckpt_manager: save_pretrained)
    (directory / "generation_config.json").unlink(missing_ok=True)  # not part of a drafter; keep the fixture small
    model = reload(kind, directory)

    g = torch.Generator().manual_seed(1000 + seed)
    m = len(spec["args"]["target_layer_ids"])
    hidden = spec["target"]["hidden"]
    context = torch.randn(CONTEXT_LEN, m, hidden, generator=g)  # [L, m, hidden] target layer outputs, in target_layer_ids order
    token_ids = torch.randint(0, 250, (CONTEXT_LEN + 1,), generator=g)  # [L + 1]: x_0..x_L (x_t is the anchor at t)
    goldens = (dspark_goldens if kind == "dspark" else eagle3_goldens)(model, context, token_ids)
    tensors = {"context": context, "token_ids": token_ids, "anchor_positions": torch.tensor(ANCHORS), **goldens}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{name}.expected.safetensors"),
              metadata={"made_by": "scripts/make_deepspec_fixtures.py", "deepspec_class": type(model).__name__})
    print(f"{name}: {sorted((k, tuple(v.shape)) for k, v in tensors.items())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspec", required=True, help="a DeepSpec checkout (the directory holding deepspec/)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.deepspec).resolve()))
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, spec) in enumerate(FIXTURES.items()):
        make(name, spec, out, seed=i)
    (out / "README.md").write_text(
        "Made by scripts/make_deepspec_fixtures.py with DeepSpec's own modeling and eval code (MIT, "
        "github.com/deepseek-ai/DeepSpec). Each <name>/ is a checkpoint in DeepSpec's released layout (bf16); "
        "<name>.expected.safetensors holds the fixed inputs and the fp32 outputs DeepSpec computes from them. "
        "Checked by tests/drafters/test_deepspec_checkpoints.py; see docs/deepspec-checkpoints.md.\n"
    )
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"total {total / 1024:.0f} KiB in {out}")



if __name__ == "__main__":
    main()
