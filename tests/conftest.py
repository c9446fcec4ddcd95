"""Shared fixtures: a tiny random Llama behind a TargetRuntime, and the real default model.

Fast tests build `Transformer(ModelConfig.tiny())` with seeded random weights named as in a
Hugging Face checkpoint (so the same dict also loads into `transformers` for reference checks)
and wrap it in a `TargetRuntime`: milliseconds per forward. Tests marked `slow` load the real
default model once per session (a few seconds once it is cached under ~/.cache/dspark).

    python -m pytest tests -q                 # everything
    python -m pytest tests -q -m "not slow"   # fast tests only
    python -m pytest tests -q -m slow         # slow tests only
    python -m pytest tests -q -m "not processes"   # none that starts another process
    python -m pytest tests -q -m browser           # the round view in headless Chromium (also `processes`)
    python -m pytest tests -q -m device --device cuda   # the device tests on a GPU (scripts/gpu_check.sh)

Tests that start other processes (dspark services, servers, a child pytest, redis-server,
kubectl) are marked `processes`, each one or, where every test of a module shares such a
process, the whole module (`pytestmark`).
"""

from __future__ import annotations

import pytest
import torch

from dspark.model.config import ModelConfig
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.transformer import Transformer

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="", help="where the `device`-marked tests run: cpu, cuda, cuda:N "
                     "(default: CUDA when torch sees a GPU, else the CPU, so that they run, and cannot rot, in CI)")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device of the `device`-marked tests (--device, scripts/gpu_check.sh)."""
    from dspark.model.target_runtime import resolve_device

    return resolve_device(request.config.getoption("--device") or "auto")


def make_runtime_on(device: torch.device | str, **kwargs) -> TargetRuntime:
    """`make_tiny_runtime(**kwargs)` placed on `device` in the modes the weights run in there,
    forced also on the CPU: "varlen" attention, no fused CPU kernels. On the CPU this is the
    GPU's code path (minus the device), which CI then exercises."""
    runtime = make_tiny_runtime(**kwargs)
    model = runtime.model
    model.set_attention("varlen")
    model.set_fused(False)
    model.place_on(device)
    return TargetRuntime(model, kv_budget_tokens=runtime.kv.budget_tokens, capture_layers=runtime.capture_layers,
                         max_model_len=runtime.max_model_len)


# Scales of the random weights: large enough that distributions are not near-uniform (greedy
# margins are wide, temperature-1 sampling is neither flat nor a point mass).
EMBED_STD = 0.3  # tied LM head: logits have std ~ EMBED_STD * sqrt(hidden_size)
# an 8-token target small enough that exact sequence probabilities of a few tokens can be
# enumerated (the chi-square losslessness tests), with two layers a drafter reads
SMALL_VOCAB_RUNTIME = {"vocab_size": 8, "num_layers": 2, "embed_std": 0.12, "compute_dtype": torch.float32, "seed": 11,
                       "capture_layers": (0, 1)}


def random_hf_state_dict(config: ModelConfig, *, seed: int, embed_std: float = EMBED_STD) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights for `config`, named and shaped as in a HF Llama/Qwen checkpoint.

    `embed_std` sets how peaked the next-token distributions are (smaller = flatter)."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def linear(out_features: int, in_features: int) -> torch.Tensor:  # [out, in]
        return torch.randn(out_features, in_features, generator=g) / in_features**0.5

    def norm(dim: int) -> torch.Tensor:  # [dim], around 1 so that a wrong norm weight shows
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    sd = {"model.embed_tokens.weight": embed_std * torch.randn(c.vocab_size, c.hidden_size, generator=g)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(c.hidden_size)
        sd[p + "post_attention_layernorm.weight"] = norm(c.hidden_size)
        sd[p + "self_attn.q_proj.weight"] = linear(c.q_size, c.hidden_size)
        sd[p + "self_attn.k_proj.weight"] = linear(c.kv_size, c.hidden_size)
        sd[p + "self_attn.v_proj.weight"] = linear(c.kv_size, c.hidden_size)
        sd[p + "self_attn.o_proj.weight"] = linear(c.hidden_size, c.q_size)
        sd[p + "mlp.gate_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
        sd[p + "mlp.up_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
        sd[p + "mlp.down_proj.weight"] = linear(c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            for name, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                sd[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(size, generator=g)
        if c.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm(c.head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(c.head_dim)
    sd["model.norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = embed_std * torch.randn(c.vocab_size, c.hidden_size, generator=g)
    return sd


def q4_1_exact(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K % 32 == 0) rounded to GGUF's Q4_1 grid, as a GGUF file's dequantised weights are:
    per block of 32, w_j = d * q_j + m with fp16 d, m and q_j in 0..15 (compact_weights.py)."""
    blocks = w.float().reshape(-1, 32)
    m = blocks.min(dim=1, keepdim=True).values.half().float()
    d = ((blocks.max(dim=1, keepdim=True).values - m) / 15).half().float().clamp_min(2**-14)
    q = torch.round((blocks - m) / d).clamp(0, 15)
    q[:, 0], q[:, 1] = 0, 15  # the extremes present, as in a real file's blocks
    return (d * q + m).reshape(w.shape)


def q8_0_exact(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] rounded to GGUF's Q8_0 grid: per block of 32, w_j = d * q_j, fp16 d, q_j in -127..127."""
    blocks = w.float().reshape(-1, 32)
    d = (blocks.abs().max(dim=1, keepdim=True).values / 127).half().float().clamp_min(2**-14)
    q = torch.round(blocks / d).clamp(-127, 127)
    q[:, 0] = 127
    return (d * q).reshape(w.shape)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read: for tests of a
    kernel spelling that is built only on some CPUs (the AVX2 pairs of dspark/model/attention.py)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def avx2_without_avx512() -> bool:
    flags = cpu_flags()
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


def compact_exact_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` with every linear weight on the Q4_1 grid and the embedding on Q8_0's: a checkpoint
    like the default model's, whose weights compact exactly (Transformer.use_compact_weights)."""
    out = dict(sd)
    for name, t in sd.items():
        if t.dim() == 2:
            out[name] = q8_0_exact(t) if name in ("model.embed_tokens.weight", "lm_head.weight") else q4_1_exact(t)
    return out


def build_transformer(
    config: ModelConfig, sd: dict[str, torch.Tensor], *, compute_dtype: torch.dtype = torch.bfloat16,
    compact: bool = False, int8_activations: bool = False,
) -> Transformer:
    """Our model with `sd` loaded, ready for inference (as Transformer.from_dir leaves it)."""
    model = Transformer(config, compute_dtype=compute_dtype)
    model.load_hf_state_dict(sd)
    model.eval().requires_grad_(False)
    if compact:
        assert model.use_compact_weights(int8_activations=int8_activations), \
            "compact=True needs fp32 weights on a block grid (compact_exact_state_dict)"
    model.prepare_for_inference()
    return model


def make_tiny_runtime(
    *,
    seed: int = 0,
    embed_std: float = EMBED_STD,
    compute_dtype: torch.dtype = torch.bfloat16,
    kv_budget_tokens: int = 1 << 16,
    capture_layers: tuple[int, ...] | None = None,
    max_model_len: int | None = None,
    compact: bool = False,
    int8_activations: bool = False,
    **config_overrides,
) -> TargetRuntime:
    """A TargetRuntime around a seeded random `ModelConfig.tiny(**config_overrides)`; compact:
    its weights rounded to the Q4_1 / Q8_0 grids and held compact (fp32 compute); with
    int8_activations, the `compact-int8` numerics (dspark/model/int8_activations.py)."""
    config = ModelConfig.tiny(**config_overrides)
    sd = random_hf_state_dict(config, seed=seed, embed_std=embed_std)
    if compact:
        sd, compute_dtype = compact_exact_state_dict(sd), torch.float32
    model = build_transformer(config, sd, compute_dtype=compute_dtype, compact=compact, int8_activations=int8_activations)
    return TargetRuntime(model, kv_budget_tokens=kv_budget_tokens, capture_layers=capture_layers, max_model_len=max_model_len)


@pytest.fixture
def tiny_runtime() -> TargetRuntime:
    """The tiny random Llama (vocab 256, 4 layers), bf16 linear layers, fresh KV per test."""
    return make_tiny_runtime()


@pytest.fixture
def tiny_runtime_factory():
    """`make_tiny_runtime(**kwargs)`: other seeds, dtypes, budgets or config overrides."""
    return make_tiny_runtime


@pytest.fixture
def hf_state_dict_for():
    """`random_hf_state_dict(config, seed=...)`: weights to load into both HF and our model."""
    return random_hf_state_dict


@pytest.fixture
def transformer_from():
    """`build_transformer(config, sd, compute_dtype=...)`."""
    return build_transformer


# ---- the real default model (tests marked slow) ------------------------------------------


@pytest.fixture(scope="session")
def real_model_dir():
    """The default model's HF directory (converted once from its GGUF package), or a skip."""
    from dspark.model.model_store import DEFAULT_MODEL, resolve_model_dir

    try:
        return resolve_model_dir(DEFAULT_MODEL)
    except FileNotFoundError as e:  # the default model's package is not installed here
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def load_real_runtime(real_model_dir):
    """`load(dtype, weights)` -> the default model's TargetRuntime, loaded once per pair per session.

    Callers must free every request they add: the runtime is shared by all slow tests.
    """
    cache: dict[tuple[str, str], TargetRuntime] = {}

    def load(dtype: str = "auto", weights: str = "auto") -> TargetRuntime:
        if (dtype, weights) not in cache:
            cache[dtype, weights] = TargetRuntime.load(TargetConfig(model=str(real_model_dir), dtype=dtype, weights=weights))
        return cache[dtype, weights]

    return load


@pytest.fixture(scope="session")
def real_runtime(load_real_runtime) -> TargetRuntime:
    """The default model as served: dtype and weights "auto" (compact exact fp32 weights: the
    default model's come from a GGUF file)."""
    return load_real_runtime("auto")


@pytest.fixture(scope="session")
def real_hf_model(real_model_dir):
    """The default model as `transformers` runs it, fp32: the reference for our runtime."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_tokenizer(real_model_dir):
    from dspark.model.tokenizer import Tokenizer

    return Tokenizer(real_model_dir)
