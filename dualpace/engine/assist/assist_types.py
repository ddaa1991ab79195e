"""The Dense Assist stream's messages as core types (assist.proto): plain values and CPU torch
tensors. The wire (dualpace.wire.assist_messages) converts them and checks structure (kinds
set, seeds present, tensor encodings); the executor checks values against the model and the
iteration in progress."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from dualpace.sampling_params import SamplingParams


@dataclass(frozen=True)
class AssistBegin:
    """Starts an iteration. sampling: one (params, seed) per row, or None to get logits back."""

    iteration_id: int
    token_ids: list[int]
    positions: list[int]
    sampling: list[tuple[SamplingParams, int]] | None
    wait_for_engine_iteration: bool = False  # the gated (NEO-like) baseline policy
    max_device_wait_ms: int = 0  # 0: wait for the device as long as the server allows
    join_engine_iteration: bool = False  # cooperative: ride in the GPU engine's next step (shm only)
    max_join_wait_us: int = 0  # the longest wait for that step; 0: up to the stage timeout (gated)
    expected_layer_us: int = 0  # the CPU's attention + ring time per layer (0: unknown)


@dataclass(frozen=True)
class AssistAttentionOutput:
    """The CPU's attention output for one layer, [batch, num_heads * head_dim]."""

    iteration_id: int
    layer: int
    attention_output: torch.Tensor


@dataclass(frozen=True)
class AssistQkv:
    """q [batch, num_heads, head_dim], k and v [batch, num_kv_heads, head_dim] of one layer, RoPE applied."""

    iteration_id: int
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class JoinHow(IntEnum):
    """How a GPU engine ran an assisted iteration (assist.proto JoinHow)."""

    UNSPECIFIED = 0  # an older server, or not said
    JOINED = 1  # in the engine's own step, one sub-batch with the engine's rows
    SPLIT = 2  # in the engine's own step, beside a second sub-batch
    STAGED = 3  # in stages of its own between the engine's layers


@dataclass(frozen=True)
class AssistJoinInfo:
    """The timeline entry of an assisted iteration: the GPU step it rode in (0: staged) and its times."""

    how: JoinHow = JoinHow.UNSPECIFIED
    engine_step_id: int = 0
    gpu_wait_us: int = 0  # how long the GPU step blocked waiting for this join's attention
    step_start_ns: int = 0  # CLOCK_MONOTONIC (time.monotonic_ns)
    step_end_ns: int = 0


@dataclass(frozen=True)
class AssistResult:
    """An iteration's outcome: sampled token ids, or float32 logits [batch, vocab] (exactly one is set)."""

    iteration_id: int
    token_ids: list[int] | None = None
    logits: torch.Tensor | None = None
    join_info: AssistJoinInfo | None = None  # None: the server said nothing (older servers)


@dataclass(frozen=True)
class AssistShmOffer:
    """Same host: the client's shared-memory segment for this stream (dualpace/engine/assist/shm_ring.py)."""

    boot_id: str
    path: str
    size_bytes: int
    token: bytes
    tcp: bool = False  # refused (another host): the client would take the data socket instead


@dataclass(frozen=True)
class AssistShmAnswer:
    """The server's answer: accepted with its token and the largest batch a slot holds, or why not."""

    accepted: bool
    token: bytes = b""
    reason: str = ""
    max_batch_rows: int = 0
    accepts_join: bool = False  # begins may set join_engine_iteration
    tcp_port: int = 0  # refused, offer.tcp: the data socket's port (0: none) and its one-time ticket
    tcp_ticket: bytes = b""
    tcp_tls: bool = False


class ShmSlotKind(IntEnum):
    """What one shared-memory slot of a Dense Assist stream holds (dualpace/engine/assist/shm_ring.py)."""

    BEGIN = 1  # up: payload = the begin's AssistUp bytes
    ATTENTION_OUTPUT = 2  # up: one tensor [batch, num_heads * head_dim]
    QKV = 3  # down: q, k, v
    RESULT_TOKENS = 4  # down: int64 token ids [batch]
    RESULT_LOGITS = 5  # down: float32 logits [batch, vocab]
    RESULT_ON_STREAM = 6  # down: the result did not fit a slot; it comes on the gRPC stream
