from dualpace.wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrationOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_OUTCOME_UNSPECIFIED: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_IN_PROGRESS: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_COMMITTED: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_FAILED: _ClassVar[MigrationOutcome]
MIGRATION_OUTCOME_UNSPECIFIED: MigrationOutcome
MIGRATION_OUTCOME_IN_PROGRESS: MigrationOutcome
MIGRATION_OUTCOME_COMMITTED: MigrationOutcome
MIGRATION_OUTCOME_FAILED: MigrationOutcome

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "prompt_token_ids", "messages", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    prompt_token_ids: _common_pb2.TokenIds
    messages: ChatMessages
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "engine", "finish_reason", "usage", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    engine: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., engine: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ListPlacementsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Placements(_message.Message):
    __slots__ = ("engines", "requests", "migrations")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EnginePlacement]
    requests: _containers.RepeatedCompositeFieldContainer[RequestPlacement]
    migrations: _containers.RepeatedCompositeFieldContainer[Migration]
    def __init__(self, engines: _Optional[_Iterable[_Union[EnginePlacement, _Mapping]]] = ..., requests: _Optional[_Iterable[_Union[RequestPlacement, _Mapping]]] = ..., migrations: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ...) -> None: ...

class EnginePlacement(_message.Message):
    __slots__ = ("name", "kind", "healthy", "kv_blocks_total", "kv_blocks_used", "num_running", "num_waiting", "itl_p50_ms", "itl_p99_ms", "block_size", "kv_blocks_cached", "prefix_index_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: _common_pb2.EngineKind
    healthy: bool
    kv_blocks_total: int
    kv_blocks_used: int
    num_running: int
    num_waiting: int
    itl_p50_ms: float
    itl_p99_ms: float
    block_size: int
    kv_blocks_cached: int
    prefix_index_blocks: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.EngineKind, str]] = ..., healthy: _Optional[bool] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., itl_p50_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ..., block_size: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_index_blocks: _Optional[int] = ...) -> None: ...

class RequestPlacement(_message.Message):
    __slots__ = ("request_id", "engine", "state", "prompt_tokens", "generated_tokens", "kv_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine: str
    state: _common_pb2.RequestState
    prompt_tokens: int
    generated_tokens: int
    kv_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., engine: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.RequestState, str]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., kv_blocks: _Optional[int] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("request_id", "from_engine", "to_engine", "outcome", "timestamp_unix_ms", "detail")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TO_ENGINE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_engine: str
    to_engine: str
    outcome: MigrationOutcome
    timestamp_unix_ms: int
    detail: str
    def __init__(self, request_id: _Optional[str] = ..., from_engine: _Optional[str] = ..., to_engine: _Optional[str] = ..., outcome: _Optional[_Union[MigrationOutcome, str]] = ..., timestamp_unix_ms: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
