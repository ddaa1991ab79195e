from dualpace.wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineGenerateRequest(_message.Message):
    __slots__ = ("new_request", "resume")
    NEW_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    new_request: NewEngineRequest
    resume: ResumeEngineRequest
    def __init__(self, new_request: _Optional[_Union[NewEngineRequest, _Mapping]] = ..., resume: _Optional[_Union[ResumeEngineRequest, _Mapping]] = ...) -> None: ...

class NewEngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "keep_running_on_disconnect", "num_prior_output_tokens", "hold_after_first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KEEP_RUNNING_ON_DISCONNECT_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOLD_AFTER_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    keep_running_on_disconnect: bool
    num_prior_output_tokens: int
    hold_after_first_token: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., keep_running_on_disconnect: _Optional[bool] = ..., num_prior_output_tokens: _Optional[int] = ..., hold_after_first_token: _Optional[bool] = ...) -> None: ...

class ResumeEngineRequest(_message.Message):
    __slots__ = ("request_id", "from_token_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_token_index: int
    def __init__(self, request_id: _Optional[str] = ..., from_token_index: _Optional[int] = ...) -> None: ...

class EngineGenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "first_token_index", "finish_reason", "usage", "engine", "migrated_to", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_TO_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_index: int
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    engine: str
    migrated_to: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token_index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., engine: _Optional[str] = ..., migrated_to: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class MigrateOutRequest(_message.Message):
    __slots__ = ("request_id", "target_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_address: str
    def __init__(self, request_id: _Optional[str] = ..., target_address: _Optional[str] = ...) -> None: ...

class MigrateOutResponse(_message.Message):
    __slots__ = ("target_engine", "total_bytes", "duration_ms", "transport")
    TARGET_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    target_engine: str
    total_bytes: int
    duration_ms: float
    transport: str
    def __init__(self, target_engine: _Optional[str] = ..., total_bytes: _Optional[int] = ..., duration_ms: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class ImportKvMessage(_message.Message):
    __slots__ = ("header", "prepare", "commit", "shm_written", "tcp_written", "shm_reserve_ahead")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SHM_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TCP_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SHM_RESERVE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    header: ImportKvHeader
    prepare: ImportKvPrepare
    commit: ImportKvCommit
    shm_written: KvShmWritten
    tcp_written: KvTcpWritten
    shm_reserve_ahead: KvShmReserveAhead
    def __init__(self, header: _Optional[_Union[ImportKvHeader, _Mapping]] = ..., prepare: _Optional[_Union[ImportKvPrepare, _Mapping]] = ..., commit: _Optional[_Union[ImportKvCommit, _Mapping]] = ..., shm_written: _Optional[_Union[KvShmWritten, _Mapping]] = ..., tcp_written: _Optional[_Union[KvTcpWritten, _Mapping]] = ..., shm_reserve_ahead: _Optional[_Union[KvShmReserveAhead, _Mapping]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ImportKvHeader(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "num_computed_tokens", "num_tokens_emitted", "layout", "total_bytes", "source_engine", "num_cached_tokens", "shm_offer", "tcp_offer", "cache_only", "cache_salt", "skip_cached", "num_prior_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFER_FIELD_NUMBER: _ClassVar[int]
    TCP_OFFER_FIELD_NUMBER: _ClassVar[int]
    CACHE_ONLY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_computed_tokens: int
    num_tokens_emitted: int
    layout: KvLayout
    total_bytes: int
    source_engine: str
    num_cached_tokens: int
    shm_offer: KvShmOffer
    tcp_offer: KvTcpOffer
    cache_only: bool
    cache_salt: str
    skip_cached: bool
    num_prior_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens_emitted: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., total_bytes: _Optional[int] = ..., source_engine: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., shm_offer: _Optional[_Union[KvShmOffer, _Mapping]] = ..., tcp_offer: _Optional[_Union[KvTcpOffer, _Mapping]] = ..., cache_only: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., skip_cached: _Optional[bool] = ..., num_prior_output_tokens: _Optional[int] = ...) -> None: ...

class KvShmOffer(_message.Message):
    __slots__ = ("boot_id", "lease_ticket")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TICKET_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    lease_ticket: bytes
    def __init__(self, boot_id: _Optional[str] = ..., lease_ticket: _Optional[bytes] = ...) -> None: ...

class KvShmReserveAhead(_message.Message):
    __slots__ = ("layout", "num_tokens", "shm_offer")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFER_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    num_tokens: int
    shm_offer: KvShmOffer
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., shm_offer: _Optional[_Union[KvShmOffer, _Mapping]] = ...) -> None: ...

class KvShmReserved(_message.Message):
    __slots__ = ("socket_name", "segment_token", "import_token", "slot_run_starts", "slot_run_lengths", "accepts_written_with_commit", "lease_on_watch", "control_on_watch", "asks_lease_ahead", "reserves_ahead")
    SOCKET_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IMPORT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_RUN_STARTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_WRITTEN_WITH_COMMIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ON_WATCH_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ON_WATCH_FIELD_NUMBER: _ClassVar[int]
    ASKS_LEASE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    RESERVES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    socket_name: str
    segment_token: bytes
    import_token: bytes
    slot_run_starts: _containers.RepeatedScalarFieldContainer[int]
    slot_run_lengths: _containers.RepeatedScalarFieldContainer[int]
    accepts_written_with_commit: bool
    lease_on_watch: bool
    control_on_watch: bool
    asks_lease_ahead: bool
    reserves_ahead: bool
    def __init__(self, socket_name: _Optional[str] = ..., segment_token: _Optional[bytes] = ..., import_token: _Optional[bytes] = ..., slot_run_starts: _Optional[_Iterable[int]] = ..., slot_run_lengths: _Optional[_Iterable[int]] = ..., accepts_written_with_commit: _Optional[bool] = ..., lease_on_watch: _Optional[bool] = ..., control_on_watch: _Optional[bool] = ..., asks_lease_ahead: _Optional[bool] = ..., reserves_ahead: _Optional[bool] = ...) -> None: ...

class KvShmDeclined(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class KvShmWritten(_message.Message):
    __slots__ = ("layer_crc32", "commit")
    LAYER_CRC32_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    layer_crc32: _containers.RepeatedScalarFieldContainer[int]
    commit: bool
    def __init__(self, layer_crc32: _Optional[_Iterable[int]] = ..., commit: _Optional[bool] = ...) -> None: ...

class KvTcpOffer(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvTcpReserved(_message.Message):
    __slots__ = ("port", "ticket", "tls")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    tls: bool
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., tls: _Optional[bool] = ...) -> None: ...

class KvTcpDeclined(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class KvTcpWritten(_message.Message):
    __slots__ = ("layer_crc32", "commit")
    LAYER_CRC32_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    layer_crc32: _containers.RepeatedScalarFieldContainer[int]
    commit: bool
    def __init__(self, layer_crc32: _Optional[_Iterable[int]] = ..., commit: _Optional[bool] = ...) -> None: ...

class ImportKvPrepare(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImportKvCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImportKvReply(_message.Message):
    __slots__ = ("prepared", "committed", "shm_reserved", "shm_declined", "tcp_reserved", "tcp_declined", "cache_held")
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SHM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    SHM_DECLINED_FIELD_NUMBER: _ClassVar[int]
    TCP_RESERVED_FIELD_NUMBER: _ClassVar[int]
    TCP_DECLINED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HELD_FIELD_NUMBER: _ClassVar[int]
    prepared: ImportKvPrepared
    committed: ImportKvCommitted
    shm_reserved: KvShmReserved
    shm_declined: KvShmDeclined
    tcp_reserved: KvTcpReserved
    tcp_declined: KvTcpDeclined
    cache_held: ImportKvCacheHeld
    def __init__(self, prepared: _Optional[_Union[ImportKvPrepared, _Mapping]] = ..., committed: _Optional[_Union[ImportKvCommitted, _Mapping]] = ..., shm_reserved: _Optional[_Union[KvShmReserved, _Mapping]] = ..., shm_declined: _Optional[_Union[KvShmDeclined, _Mapping]] = ..., tcp_reserved: _Optional[_Union[KvTcpReserved, _Mapping]] = ..., tcp_declined: _Optional[_Union[KvTcpDeclined, _Mapping]] = ..., cache_held: _Optional[_Union[ImportKvCacheHeld, _Mapping]] = ...) -> None: ...

class ImportKvCacheHeld(_message.Message):
    __slots__ = ("num_held_tokens",)
    NUM_HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_held_tokens: int
    def __init__(self, num_held_tokens: _Optional[int] = ...) -> None: ...

class CopyPrefixRequest(_message.Message):
    __slots__ = ("token_ids", "target_address")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    target_address: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., target_address: _Optional[str] = ...) -> None: ...

class CopyPrefixResponse(_message.Message):
    __slots__ = ("num_tokens", "num_sent_tokens", "duration_ms", "target_engine")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_sent_tokens: int
    duration_ms: float
    target_engine: str
    def __init__(self, num_tokens: _Optional[int] = ..., num_sent_tokens: _Optional[int] = ..., duration_ms: _Optional[float] = ..., target_engine: _Optional[str] = ...) -> None: ...

class ImportKvPrepared(_message.Message):
    __slots__ = ("total_bytes", "kv_blocks")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    kv_blocks: int
    def __init__(self, total_bytes: _Optional[int] = ..., kv_blocks: _Optional[int] = ...) -> None: ...

class ImportKvCommitted(_message.Message):
    __slots__ = ("request_id", "engine")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine: str
    def __init__(self, request_id: _Optional[str] = ..., engine: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadSnapshot(_message.Message):
    __slots__ = ("engine", "kind", "serving", "num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used", "block_size", "itl_p50_ms", "itl_p99_ms", "num_iterations", "timestamp_unix_ms", "kv_blocks_cached", "num_preemptions")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    kind: _common_pb2.EngineKind
    serving: bool
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    itl_p50_ms: float
    itl_p99_ms: float
    num_iterations: int
    timestamp_unix_ms: int
    kv_blocks_cached: int
    num_preemptions: int
    def __init__(self, engine: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.EngineKind, str]] = ..., serving: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., block_size: _Optional[int] = ..., itl_p50_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ..., num_iterations: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "state", "prompt_tokens", "generated_tokens", "kv_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: _common_pb2.RequestState
    prompt_tokens: int
    generated_tokens: int
    kv_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.RequestState, str]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., kv_blocks: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine", "kind", "model", "architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_context_tokens", "block_size", "dtype", "device", "version", "cpu_kernel_variant")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNEL_VARIANT_FIELD_NUMBER: _ClassVar[int]
    engine: str
    kind: _common_pb2.EngineKind
    model: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context_tokens: int
    block_size: int
    dtype: str
    device: str
    version: str
    cpu_kernel_variant: str
    def __init__(self, engine: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.EngineKind, str]] = ..., model: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., cpu_kernel_variant: _Optional[str] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("events", "engine")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    engine: str
    def __init__(self, events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., engine: _Optional[str] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("event_id", "stored", "removed", "all_cleared")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stored: KvBlockStored
    removed: KvBlockRemoved
    all_cleared: KvAllBlocksCleared
    def __init__(self, event_id: _Optional[int] = ..., stored: _Optional[_Union[KvBlockStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlockRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[KvAllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvBlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class KvBlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class KvAllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: str
    def __init__(self, medium: _Optional[str] = ...) -> None: ...
