from dspark.protos.dspark.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerationRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_new_tokens", "params", "stop_token_ids", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    params: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "finish_reason", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_finished", "num_rounds", "generation_tokens_per_second", "mean_accepted_length", "num_drafters", "num_verifiers")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_finished: int
    num_rounds: int
    generation_tokens_per_second: float
    mean_accepted_length: float
    num_drafters: int
    num_verifiers: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_rounds: _Optional[int] = ..., generation_tokens_per_second: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., num_drafters: _Optional[int] = ..., num_verifiers: _Optional[int] = ...) -> None: ...
