from dspark.protos.dspark.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterAddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DrafterAddResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestFeatures(_message.Message):
    __slots__ = ("request_id", "features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    features: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AppendFeaturesRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestFeatures]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestFeatures, _Mapping]]] = ...) -> None: ...

class AppendFeaturesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterRemoveRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrafterRemoveResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "max_draft_tokens", "token_offset", "free_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FREE_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    params: _common_pb2.SamplingParams
    max_draft_tokens: int
    token_offset: int
    free_only: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_draft_tokens: _Optional[int] = ..., token_offset: _Optional[int] = ..., free_only: _Optional[bool] = ...) -> None: ...

class DraftRoundRequest(_message.Message):
    __slots__ = ("round_id", "requests")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    requests: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    def __init__(self, round_id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("round_id", "request_id", "proposal")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    request_id: str
    proposal: _common_pb2.DraftProposal
    def __init__(self, round_id: _Optional[int] = ..., request_id: _Optional[str] = ..., proposal: _Optional[_Union[_common_pb2.DraftProposal, _Mapping]] = ...) -> None: ...

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("name", "needs_hidden_states", "capture_layers", "provides_confidences", "vocab_size", "hidden_size", "free_proposals", "block_size", "draft_vocab_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROVIDES_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREE_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    needs_hidden_states: bool
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    provides_confidences: bool
    vocab_size: int
    hidden_size: int
    free_proposals: bool
    block_size: int
    draft_vocab_size: int
    def __init__(self, name: _Optional[str] = ..., needs_hidden_states: _Optional[bool] = ..., capture_layers: _Optional[_Iterable[int]] = ..., provides_confidences: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., free_proposals: _Optional[bool] = ..., block_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ...) -> None: ...
