"""The serving system's configuration: one typed tree, the single source of serving defaults.

    config = ServingConfig.load("serving.toml")        # defaults <- file <- DSPARK_<SECTION>_<KEY>
    config.verifier.address                             # what the scheduler dials
    config.verifier.bind                                # what the verifier listens on

Precedence, lowest first: the defaults below; the command's own defaults, where it has some
(dspark/command_config.py); a JSON (`.json`) or TOML (`.toml`) file of `{section: {key: value}}`
(path given, else $DSPARK_CONFIG, else none); environment variables `DSPARK_<SECTION>_<KEY>`
(e.g. `DSPARK_VERIFIER_PORT=6000`, `DSPARK_SCHEDULER_POLICY=dspark`); then explicit overrides
(the command-line flags given). Every `dspark` command resolves its configuration this one way
(dspark/command_config.py). Unknown sections or keys in a file, and unknown keys
of a known section in the environment, are errors that name them (a typo must not be ignored);
environment variables of other sections (DSPARK_CACHE_DIR, ...) are not ours and are left alone.

Each service section has `host`/`port` (where it listens; 0 = a free port) and `address` (where
clients dial it; empty = host:port). In Kubernetes a pod listens on 0.0.0.0 and its clients dial
the service name, e.g. DSPARK_VERIFIER_HOST=0.0.0.0 and DSPARK_VERIFIER_ADDRESS=verifier:50053.
Optional values use an empty string or 0 for "not set", so that every key has one plain type and
can be given as an environment variable. This module imports nothing heavy (no torch).

Two keys hold secrets (`ServingConfig.secret_keys()`): gateway.api_keys and rpc.auth_token.
They are hidden from repr, and in Kubernetes they come from Secrets, not from the ConfigMap.
API keys are stored as SHA-256 hashes: plain keys given here are hashed when the section is
built, so no plain key is kept or written out (`to_json`). rpc.tls_key_path is no secret: it
only says where the TLS key lies (a mounted Secret's file).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dspark.api_key_hashes import normalize_api_keys

__all__ = [
    "DEFAULT_MODEL_NAME", "DrafterSection", "GatewaySection", "ModelSection", "ObservabilitySection", "RedisSection",
    "RpcSection", "SchedulerSection", "ServingConfig", "VerifierSection",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # dspark.model.model_store.DEFAULT_MODEL (not imported: it pulls in torch)
ENV_PREFIX = "DSPARK_"
CONFIG_PATH_ENV = "DSPARK_CONFIG"
LEGACY_API_KEYS_ENV = "DSPARK_API_KEYS"  # the older name of gateway.api_keys: its keys are accepted too
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
SECRET = {"secret": True}  # field metadata: a key given from a secret store (k8s Secret), never printed by repr
MIN_TOKEN_CHARS = 16
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")  # model.device; whether the device exists is checked at load


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_port(section: str, port: int) -> None:
    _check(0 <= port <= 65535, f"{section}.port must be in [0, 65535] (0 = any free port), got {port}")


# How the target's linear layers hold their weights (TargetConfig.weights, `--weights`):
#   compact       the exact fp32 weights in the block format they came in (Q4_1 / Q8_0 for the
#                 default model), fp32 activations and sums (dspark/model/compact_weights.py)
#   compact-int8  the same weights, but each activation row entering a Q4_1 or Q8_0 weight (the
#                 LM head's included) rounded to int8 per block of 32, as llama.cpp does: a
#                 different (close) model, 2-3x faster GEMMs, still batch-invariant
#                 (dspark/model/int8_activations.py)
#   dense         a dense `dtype` matrix (oneDNN)
#   auto          compact where every layer has an exact format and dtype is auto or float32
WEIGHT_CHOICES = ("auto", "compact", "compact-int8", "dense")
# the rejection sampler a verifier runs: "auto" = the fused Triton kernel when the logits live on
# CUDA, else the torch reference (dspark/engine/verifier.py: resolve_sampler_backend)
SAMPLER_BACKENDS = ("auto", "torch", "triton")
WEIGHTS_HELP = ("linear weights: compact = the exact fp32 weights in the checkpoint's block format (3-5x fewer bytes "
                "per step); compact-int8 = those weights with int8 activations, llama.cpp's numerics (2-3x faster "
                "GEMMs, a close but different model); dense; auto = compact where every layer has one")


@dataclass(frozen=True)
class ModelSection:
    """The target model every service serves."""

    name: str = DEFAULT_MODEL_NAME  # the default model's name, or a local HF Llama/Qwen directory
    dtype: str = "auto"  # compute dtype of the linear layers: auto (bf16 where the hardware has it) | bfloat16 | float32
    weights: str = "auto"  # linear weights (WEIGHT_CHOICES): compact | compact-int8 | dense | auto (compact where exact)
    kv_budget_mb: int = 4096  # memory for all requests' KV caches (verifier)
    max_model_len: int = 0  # context window; 0 = the model's max_position_embeddings
    # where the target (and a drafter's weights) run: auto (the first CUDA device torch sees, else
    # the CPU) | cpu | cuda | cuda:N; per service through its environment (DSPARK_MODEL_DEVICE)
    device: str = "auto"

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.name must be the default model's name or a model directory, got ''")
        _check(DEVICE_PATTERN.fullmatch(self.device) is not None,
               f"model.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check(self.dtype in ("auto", "bfloat16", "float32"), f"model.dtype must be 'auto', 'bfloat16' or 'float32', got {self.dtype!r}")
        _check(self.weights in WEIGHT_CHOICES, f"model.weights must be one of {', '.join(map(repr, WEIGHT_CHOICES))}, got {self.weights!r}")
        _check(not (self.weights.startswith("compact") and self.dtype == "bfloat16"),
               f"model.weights {self.weights!r} computes in float32: it cannot go with model.dtype 'bfloat16'")
        _check(self.kv_budget_mb > 0, f"model.kv_budget_mb must be > 0, got {self.kv_budget_mb}")
        _check(self.max_model_len >= 0, f"model.max_model_len must be >= 0 (0 = the model's), got {self.max_model_len}")


@dataclass(frozen=True)
class _Endpoint:
    host: str
    port: int
    address: str

    @property
    def bind(self) -> str:
        """host:port to listen on."""
        return f"{self.host}:{self.port}"

    @property
    def dial(self) -> str:
        """Where clients connect: `address`, else host:port (0.0.0.0 dialled as 127.0.0.1)."""
        if self.address:
            return self.address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "[::]") else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class DrafterSection(_Endpoint):
    """The drafter service (`dspark drafter`) and which drafter it hosts."""

    host: str = "127.0.0.1"
    port: int = 50052
    address: str = ""
    # dspark.drafters.drafter_names(); "dspark"/"dspark-lookup" with no path = the checkpoint shipped for the
    # default model. dspark-lookup: DSpark plus lookup proposals where the context repeats (greedy
    # τ 2.05 against 1.35 offline, docs/results/lookup.md); same checkpoint, same exactness.
    name: str = "dspark-lookup"
    path: str = ""  # checkpoint directory of a trained drafter (dspark); "" = none
    top_k: int = 0  # truncate the drafter's rows to its top k (sparse on the wire); 0 = full rows

    def __post_init__(self) -> None:
        _check_port("drafter", self.port)
        _check(bool(self.name), "drafter.name must name a drafter, got ''")
        _check(self.top_k >= 0, f"drafter.top_k must be >= 0 (0 = full rows), got {self.top_k}")


@dataclass(frozen=True)
class VerifierSection(_Endpoint):
    """The verifier service (`dspark verifier`): the target model, KV caches, rejection sampler."""

    host: str = "127.0.0.1"
    port: int = 50053
    address: str = ""
    sps_max_batch: int = 64  # profile SPS(B) at start-up up to this B (tokens); 0 skips it
    sps_tokens_per_request: int = 8  # query tokens per request in the profile's batches (γ + 1)
    sampler_backend: str = "auto"  # SAMPLER_BACKENDS: torch | triton | auto (Triton when CUDA is present)

    def __post_init__(self) -> None:
        _check_port("verifier", self.port)
        _check(self.sps_max_batch >= 0, f"verifier.sps_max_batch must be >= 0 (0 = no profile), got {self.sps_max_batch}")
        _check(self.sps_tokens_per_request >= 1, f"verifier.sps_tokens_per_request must be >= 1, got {self.sps_tokens_per_request}")
        _check(self.sampler_backend in SAMPLER_BACKENDS,
               f"verifier.sampler_backend must be one of {', '.join(map(repr, SAMPLER_BACKENDS))}, got {self.sampler_backend!r}")


@dataclass(frozen=True)
class SchedulerSection(_Endpoint):
    """The scheduler service (`dspark scheduler`): the round loop over the verifier and drafter."""

    host: str = "127.0.0.1"
    port: int = 50051
    address: str = ""
    gamma: int = 7  # draft tokens per round (block size γ)
    policy: str = "dspark"  # none | fixed:K | threshold:C | dspark (Algorithm 1) | dspark-async; "" = all γ drafts every round

    def __post_init__(self) -> None:
        _check_port("scheduler", self.port)
        _check(self.gamma >= 0, f"scheduler.gamma must be >= 0, got {self.gamma}")


@dataclass(frozen=True)
class GatewaySection:
    """The OpenAI-compatible HTTP gateway."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_tokens_limit: int = 2048  # largest max_tokens a client may ask for
    model_name: str = ""  # the id clients send in `model`; "" = derived from model.name
    # HTTP connection limits (gateway/connection_limits.py): a flood of connections or a client
    # that sends slowly holds a bounded number of slots for a bounded time.
    max_connections: int = 512  # open connections; a request on one beyond it gets 503 at once
    header_timeout_s: float = 10.0  # a request line and headers must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive within this once its headers are in
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    # a response its client takes nothing of (the server's write buffer stays full) for this long:
    # the connection is cut and the request cancelled, as if the client had left
    slow_reader_timeout_s: float = 30.0
    max_header_bytes: int = 16384  # request line + headers; beyond it the request is a 400
    # Request limits (gateway/guard.py, gateway/rate_limit.py). "Per client": per API key, or per
    # client address when no keys are configured. In Redis (distributed mode) when redis.url is set.
    api_keys: str = field(default="", repr=False, metadata=SECRET)  # comma-separated sha256:<hex> (`dspark hash-key`) or plain keys (hashed at load); "" = no authentication
    requests_per_minute: int = 0  # per client; 0 = no rate limit
    burst: int = 0  # requests a client may send at once before the per-minute rate applies; 0 = requests_per_minute
    max_concurrent_requests: int = 0  # per client, in flight at once (a stream until it ends); 0 = no limit
    max_prompt_tokens: int = 0  # longest prompt; 0 = the context window minus one
    max_body_bytes: int = 1048576  # largest request body; beyond it 413

    def __post_init__(self) -> None:
        if self.api_keys:  # plain keys become hashes here: no plain key is kept (or written out by to_json)
            try:
                hashes = normalize_api_keys(self.api_keys)
            except ValueError as e:
                raise ValueError(f"gateway.api_keys: {e}") from None
            object.__setattr__(self, "api_keys", ",".join(hashes))
        for name in ("requests_per_minute", "burst", "max_concurrent_requests", "max_prompt_tokens"):
            _check(getattr(self, name) >= 0, f"gateway.{name} must be >= 0 (0 = not set), got {getattr(self, name)}")
        _check(self.max_body_bytes >= 1, f"gateway.max_body_bytes must be >= 1, got {self.max_body_bytes}")
        _check_port("gateway", self.port)
        _check(self.max_tokens_limit >= 1, f"gateway.max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        _check(self.max_connections >= 1, f"gateway.max_connections must be >= 1, got {self.max_connections}")
        _check(self.max_header_bytes >= 1024, f"gateway.max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "slow_reader_timeout_s"):
            _check(getattr(self, name) > 0, f"gateway.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RedisSection:
    """The bus between gateways and schedulers in the distributed mode."""

    url: str = ""  # e.g. redis://localhost:6379/0; "" = the in-memory bus (one process)


@dataclass(frozen=True)
class RpcSection:
    """gRPC deadlines, limits and security (token, mutual TLS) of the calls between the services."""

    deadline_s: float = 10.0  # control calls: add / remove requests, info, health, stats
    draft_deadline_s: float = 60.0  # one Draft round (the whole stream)
    verify_deadline_s: float = 300.0  # one Verify round (a long prefill on a CPU takes seconds)
    connect_timeout_s: float = 120.0  # how long a client waits for its server to come up at start
    startup_timeout_s: float = 1800.0  # `dspark up`: how long a service may take to report SERVING
    max_message_mb: int = 512  # largest gRPC message (a long prompt's hidden states are MBs)
    # shared secret of the internal calls (services/grpc_auth.py): sent as `authorization: Bearer`,
    # required by every service but health; "" = none (`dspark up` then makes one for its children)
    auth_token: str = field(default="", repr=False, metadata=SECRET)
    # mutual TLS of the internal calls (services/grpc_tls.py): PEM files, all three or none; "" = plaintext (h2c)
    tls_ca_path: str = ""  # CA bundle: servers accept only clients, clients only servers, with a certificate it signed
    tls_cert_path: str = ""  # this process's certificate (chain), presented as server and as client
    tls_key_path: str = ""  # its private key, unencrypted (a file only the service can read: a Secret)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str):
                _check(value > 0, f"rpc.{f.name} must be > 0, got {value}")
        tls = {name: getattr(self, name) for name in ("tls_ca_path", "tls_cert_path", "tls_key_path")}
        given = [f"rpc.{name}" for name, value in tls.items() if value]
        _check(len(given) in (0, len(tls)), "rpc.tls_ca_path, rpc.tls_cert_path and rpc.tls_key_path go together "
                                            f"(mutual TLS): set all three or none, got only {given}")
        token = self.auth_token
        _check(not token or (len(token) >= MIN_TOKEN_CHARS and token.isascii() and token.isprintable() and " " not in token),
               f"rpc.auth_token must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces "
               f"(got {len(token)} characters; e.g. `openssl rand -hex 32`)")


@dataclass(frozen=True)
class ObservabilitySection:
    """OpenTelemetry traces over OTLP and the scheduler's Prometheus metrics (dspark/observability).

    Tracing is off unless an OTLP endpoint is given here or in the OpenTelemetry SDK's own
    OTEL_EXPORTER_OTLP_ENDPOINT (what deploy/k8s sets); each process names itself with
    OTEL_SERVICE_NAME, else dspark-<service>."""

    # where traces go, e.g. http://localhost:4318 (http/protobuf) or http://jaeger:4317 (grpc);
    # "" = $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing
    otlp_endpoint: str = ""
    otlp_protocol: str = ""  # grpc | http/protobuf; "" = $OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf
    sample_ratio: float = 1.0  # fraction of new traces recorded; a request that arrives sampled is always recorded
    metrics_port: int = 9464  # the scheduler's Prometheus endpoint (HTTP /metrics, on scheduler.host); 0 = none

    def __post_init__(self) -> None:
        _check(self.otlp_protocol in ("", "grpc", "http/protobuf"),
               f"observability.otlp_protocol must be 'grpc', 'http/protobuf' or '' (the SDK's variable), "
               f"got {self.otlp_protocol!r}")
        _check(0.0 <= self.sample_ratio <= 1.0, f"observability.sample_ratio must be in [0, 1], got {self.sample_ratio}")
        _check(0 <= self.metrics_port <= 65535,
               f"observability.metrics_port must be in [0, 65535] (0 = none), got {self.metrics_port}")


@dataclass(frozen=True)
class ServingConfig:
    model: ModelSection = field(default_factory=ModelSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    verifier: VerifierSection = field(default_factory=VerifierSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    gateway: GatewaySection = field(default_factory=GatewaySection)
    redis: RedisSection = field(default_factory=RedisSection)
    rpc: RpcSection = field(default_factory=RpcSection)
    observability: ObservabilitySection = field(default_factory=ObservabilitySection)

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        command_defaults: Mapping[str, Mapping[str, Any]] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> ServingConfig:
        """Defaults <- `command_defaults` <- file (`path`, else $DSPARK_CONFIG) <- environment <-
        `overrides` (a command's flags). dspark/command_config.py calls it for every command.

        Two rules beyond the layers: the keys of DSPARK_API_KEYS (the older variable) are added to
        gateway.api_keys as the file and DSPARK_GATEWAY_API_KEYS give it, and overrides replace
        both; with drafter.name = none and no scheduler.policy given (by file, environment or
        overrides) the policy is none: there are no drafts to schedule, and the default policy
        would refuse a drafter without confidences."""
        env = os.environ if env is None else env
        path = path if path is not None else env.get(CONFIG_PATH_ENV) or None
        from_file = _read_file(Path(path)) if path is not None else {}
        from_env, overrides = _from_env(env), overrides or {}
        config = cls().updated(command_defaults or {}, source="the command's defaults")
        config = config.updated(from_file, source=str(path)).updated(from_env, source="environment")
        if env.get(LEGACY_API_KEYS_ENV, "").strip():
            config = config.updated({"gateway": {"api_keys": f"{config.gateway.api_keys},{env[LEGACY_API_KEYS_ENV]}"}},
                                    source=LEGACY_API_KEYS_ENV)
        config = config.updated(overrides, source="overrides")
        if config.drafter.name == "none" and not any("policy" in given.get("scheduler", {})
                                                     for given in (from_file, from_env, overrides)):
            config = replace(config, scheduler=replace(config.scheduler, policy="none"))
        return config

    def updated(self, values: Mapping[str, Mapping[str, Any]], *, source: str = "overrides") -> ServingConfig:
        """A copy with `{section: {key: value}}` applied; values are checked against the field types."""
        sections = {f.name for f in fields(self)}
        changes = {}
        for section, keys in values.items():
            _check(section in sections, f"{source}: unknown section {section!r}; expected one of {sorted(sections)}")
            _check(isinstance(keys, Mapping), f"{source}: section {section!r} must be a table of keys, got {keys!r}")
            current = getattr(self, section)
            types = _field_types(type(current))
            unknown = sorted(set(keys) - set(types))
            _check(not unknown, f"{source}: unknown key(s) {unknown} in section {section!r}; expected some of {sorted(types)}")
            typed = {k: _coerce(v, types[k], f"{source}: {section}.{k}") for k, v in keys.items()}
            changes[section] = replace(current, **typed)
        return replace(self, **changes)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def secret_keys(cls) -> tuple[tuple[str, str], ...]:
        """(section, key) of the keys marked SECRET: given from a secret store (a Kubernetes
        Secret, a file only its service reads), never from a ConfigMap, and hidden from repr."""
        return tuple((s.name, f.name) for s in fields(cls) for f in fields(typing.get_type_hints(cls)[s.name])
                     if f.metadata.get("secret"))


# ---- helpers ----------------------------------------------------------------------------------


def _field_types(section_type: type) -> dict[str, type]:
    hints = typing.get_type_hints(section_type)
    return {f.name: hints[f.name] for f in fields(section_type)}


def _coerce(value: Any, kind: type, where: str) -> Any:
    """`value` (from a file: JSON/TOML scalars; from the environment: a string) as `kind`."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{where} must be a boolean (true/false/1/0), got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where} must be a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {value!r}")
    raise TypeError(f"{where}: unsupported config field type {kind!r}")


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: {e}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from None
    else:
        raise ValueError(f"config file {path} must end in .toml or .json")
    _check(isinstance(data, dict), f"{path}: the top level must be a table of sections, got {type(data).__name__}")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """DSPARK_<SECTION>_<KEY> variables of our sections, as {section: {key: raw string}}."""
    sections = {name: _field_types(kind) for name, kind in typing.get_type_hints(ServingConfig).items()}
    out: dict[str, dict[str, str]] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_PATH_ENV:
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section, _, key = rest.partition("_")
        if section not in sections:
            continue  # DSPARK_CACHE_DIR and friends: not serving configuration
        if key not in sections[section]:
            raise ValueError(f"environment variable {name}: unknown key {key!r} of section {section!r}; "
                             f"expected one of {sorted(sections[section])}")
        out.setdefault(section, {})[key] = raw
    return out
