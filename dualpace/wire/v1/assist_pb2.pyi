from dualpace.wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinHow(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOIN_HOW_UNSPECIFIED: _ClassVar[JoinHow]
    JOIN_HOW_JOINED: _ClassVar[JoinHow]
    JOIN_HOW_SPLIT: _ClassVar[JoinHow]
    JOIN_HOW_STAGED: _ClassVar[JoinHow]
JOIN_HOW_UNSPECIFIED: JoinHow
JOIN_HOW_JOINED: JoinHow
JOIN_HOW_SPLIT: JoinHow
JOIN_HOW_STAGED: JoinHow

class AssistUp(_message.Message):
    __slots__ = ("begin", "shm_offer")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFER_FIELD_NUMBER: _ClassVar[int]
    begin: AssistBegin
    shm_offer: AssistShmOffer
    def __init__(self, begin: _Optional[_Union[AssistBegin, _Mapping]] = ..., shm_offer: _Optional[_Union[AssistShmOffer, _Mapping]] = ...) -> None: ...

class AssistShmOffer(_message.Message):
    __slots__ = ("boot_id", "path", "size_bytes", "token", "tcp")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    path: str
    size_bytes: int
    token: bytes
    tcp: bool
    def __init__(self, boot_id: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., token: _Optional[bytes] = ..., tcp: _Optional[bool] = ...) -> None: ...

class AssistShmAnswer(_message.Message):
    __slots__ = ("accepted", "token", "reason", "max_batch_rows", "accepts_join", "tcp_port", "tcp_ticket", "tcp_tls")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_JOIN_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_TICKET_FIELD_NUMBER: _ClassVar[int]
    TCP_TLS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    token: bytes
    reason: str
    max_batch_rows: int
    accepts_join: bool
    tcp_port: int
    tcp_ticket: bytes
    tcp_tls: bool
    def __init__(self, accepted: _Optional[bool] = ..., token: _Optional[bytes] = ..., reason: _Optional[str] = ..., max_batch_rows: _Optional[int] = ..., accepts_join: _Optional[bool] = ..., tcp_port: _Optional[int] = ..., tcp_ticket: _Optional[bytes] = ..., tcp_tls: _Optional[bool] = ...) -> None: ...

class AssistBegin(_message.Message):
    __slots__ = ("iteration_id", "token_ids", "positions", "return_logits", "sampling", "wait_for_engine_iteration", "max_device_wait_ms", "join_engine_iteration", "max_join_wait_us", "expected_layer_us")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_ENGINE_ITERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    JOIN_ENGINE_ITERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_JOIN_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYER_US_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    return_logits: bool
    sampling: _containers.RepeatedCompositeFieldContainer[_common_pb2.SamplingParams]
    wait_for_engine_iteration: bool
    max_device_wait_ms: int
    join_engine_iteration: bool
    max_join_wait_us: int
    expected_layer_us: int
    def __init__(self, iteration_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., return_logits: _Optional[bool] = ..., sampling: _Optional[_Iterable[_Union[_common_pb2.SamplingParams, _Mapping]]] = ..., wait_for_engine_iteration: _Optional[bool] = ..., max_device_wait_ms: _Optional[int] = ..., join_engine_iteration: _Optional[bool] = ..., max_join_wait_us: _Optional[int] = ..., expected_layer_us: _Optional[int] = ...) -> None: ...

class AssistDown(_message.Message):
    __slots__ = ("result", "shm_answer")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SHM_ANSWER_FIELD_NUMBER: _ClassVar[int]
    result: AssistResult
    shm_answer: AssistShmAnswer
    def __init__(self, result: _Optional[_Union[AssistResult, _Mapping]] = ..., shm_answer: _Optional[_Union[AssistShmAnswer, _Mapping]] = ...) -> None: ...

class AssistResult(_message.Message):
    __slots__ = ("iteration_id", "sampled", "logits", "join_info")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    JOIN_INFO_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    sampled: _common_pb2.TokenIds
    logits: _common_pb2.Tensor
    join_info: AssistJoinInfo
    def __init__(self, iteration_id: _Optional[int] = ..., sampled: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., logits: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., join_info: _Optional[_Union[AssistJoinInfo, _Mapping]] = ...) -> None: ...

class AssistJoinInfo(_message.Message):
    __slots__ = ("engine_step_id", "how", "gpu_wait_us", "step_start_ns", "step_end_ns")
    ENGINE_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HOW_FIELD_NUMBER: _ClassVar[int]
    GPU_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    STEP_START_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_END_NS_FIELD_NUMBER: _ClassVar[int]
    engine_step_id: int
    how: JoinHow
    gpu_wait_us: int
    step_start_ns: int
    step_end_ns: int
    def __init__(self, engine_step_id: _Optional[int] = ..., how: _Optional[_Union[JoinHow, str]] = ..., gpu_wait_us: _Optional[int] = ..., step_start_ns: _Optional[int] = ..., step_end_ns: _Optional[int] = ...) -> None: ...
