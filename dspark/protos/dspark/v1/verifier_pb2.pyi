from dspark.protos.dspark.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierAddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "params", "num_kv_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    num_kv_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_kv_tokens: _Optional[int] = ...) -> None: ...

class VerifierAddResponse(_message.Message):
    __slots__ = ("free_kv_tokens",)
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    free_kv_tokens: int
    def __init__(self, free_kv_tokens: _Optional[int] = ...) -> None: ...

class VerifierRemoveRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifierRemoveResponse(_message.Message):
    __slots__ = ("num_removed", "free_kv_tokens")
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    free_kv_tokens: int
    def __init__(self, num_removed: _Optional[int] = ..., free_kv_tokens: _Optional[int] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("round_id", "request_ids", "anchor_token_ids", "num_draft_tokens", "draft_token_ids", "sparse", "dense", "capture_hidden_states", "num_logprobs")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    anchor_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sparse: _common_pb2.SparseRows
    dense: _common_pb2.DenseRows
    capture_hidden_states: bool
    num_logprobs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., anchor_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., sparse: _Optional[_Union[_common_pb2.SparseRows, _Mapping]] = ..., dense: _Optional[_Union[_common_pb2.DenseRows, _Mapping]] = ..., capture_hidden_states: _Optional[bool] = ..., num_logprobs: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("round_id", "request_ids", "num_accepted", "emitted_token_ids", "max_num_draft", "hidden_states", "num_hidden_positions", "logprobs")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    emitted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_num_draft: int
    hidden_states: _common_pb2.Tensor
    num_hidden_positions: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, round_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., emitted_token_ids: _Optional[_Iterable[int]] = ..., max_num_draft: _Optional[int] = ..., hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_hidden_positions: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class GetSPSProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SPSProfile(_message.Message):
    __slots__ = ("batch_sizes", "step_seconds")
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    step_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch_sizes: _Optional[_Iterable[int]] = ..., step_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class GetVerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "capture_layers", "hidden_size", "kv_budget_tokens", "free_kv_tokens", "sampler_backend")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    kv_budget_tokens: int
    free_kv_tokens: int
    sampler_backend: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., capture_layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., free_kv_tokens: _Optional[int] = ..., sampler_backend: _Optional[str] = ...) -> None: ...
