"""GPU Dense Assist: the dense stages of a CPU engine's iteration, run on the GPU.

One `AssistSession` per stream walks each iteration through its layers:

    begin             -> embed, RoPE angles, pre_attention(0)      -> qkv(0)
    attention_output 0 -> post_attention(0), pre_attention(1)       -> qkv(1)
    ...
    attention_output L -> post_attention(L), logits, sampling       -> result

The residual stream (hidden states) stays on the model's device between
messages; only q, k, v go down and the attention output comes up. Every
message is checked against the iteration in progress before any device work,
and a bad one raises InvalidArgument naming the field.

Device sharing (DeviceHandoff, dualpace/engine/gate.py). Each message's device work is
one *stage* that takes the GPU engine's step lock for that stage only: the CPU's
attention between two messages runs with the device free for the GPU engine. The
engine's forward offers the device between its layers (PagedForward.between_layers ->
DeviceHandoff.yield_to_waiting), so a stage waits for at most one engine layer, and the
engine pays only the assisted dense time. The model weights are the only state the two
share, read-only: the residual stream lives in the session, the KV on the CPU engine.

Gated baseline (begin.wait_for_engine_iteration, NEO-like): unchanged from the coarse
design: the iteration waits for the engine's iteration boundary, then holds the device
lock from its begin to its result, so the GPU and CPU iterations take turns: the downgrade
of a gated join this server cannot run (no shared memory, or no join desk).

Joins (begin.join_engine_iteration, ring streams of a server with a JoinDesk): the begin's
rows ride in the GPU engine's next step instead of stages of their own, driven by the step
thread through a gpu_service/join_channel.py channel.

Bounded wait (begin.max_device_wait_ms): a budget per iteration: the waits of all its
stages for the device add up to at most that; past it the stage raises Overloaded
(RESOURCE_EXHAUSTED) and the CPU engine redoes the iteration locally. Without a budget (0)
each wait is still bounded by the server's stage timeout (`--assist-stage-timeout-s`), past
which the stage raises AssistExpired (DEADLINE_EXCEEDED); see gpu_service/assist_limits.py.

Methods are synchronous and meant to be called off the event loop; the same code runs on
CUDA and on the CPU device.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from dualpace.engine.gate import DeviceHandoff, IterationGate
from dualpace.errors import InvalidArgument, Overloaded
from dualpace.model.transformer import Transformer
from dualpace.penalties import has_penalties
from dualpace.sampling import SamplingParams
from dualpace.engine.assist.assist_types import (
    AssistAttentionOutput,
    AssistBegin,
    AssistJoinInfo,
    AssistQkv,
    AssistResult,
    JoinHow,
)
from dualpace.engine.assist.join_desk import JoinDesk, JoinOutcome, JoinRequest, RemoteRowsChannel
from gpu_service.assist_limits import DEFAULT_STAGE_TIMEOUT_S, AssistExpired
from gpu_service.join_channel import result_from_logits

log = logging.getLogger(__name__)
RESULT_SENT = object()  # begin's reply when a joined step already sent the result through the ring


@dataclass
class _Iteration:
    """An iteration in progress: its request and the residual stream on the device."""

    begin: AssistBegin
    hidden: torch.Tensor  # [batch, hidden], model device and dtype
    rope: tuple[torch.Tensor, torch.Tensor]
    next_layer: int  # the layer whose attention output is expected next


def _as_handoff(device: DeviceHandoff | threading.Lock | None) -> DeviceHandoff:
    return device if isinstance(device, DeviceHandoff) else DeviceHandoff(device)


class DenseAssistExecutor:
    """Holds the model and the device handoff; hands out one session per stream.

    `device` is the DeviceHandoff whose yield_to_waiting the GPU engine's forward calls
    between layers, or a bare lock (then the engine only frees it between iterations).
    """

    def __init__(self, model: Transformer, device: DeviceHandoff | threading.Lock | None = None,
                 gate: IterationGate | None = None, stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
                 desk: JoinDesk | None = None):
        self.model = model
        self.handoff = _as_handoff(device)
        self.device_lock = self.handoff.lock
        self.gate = gate if gate is not None else IterationGate()  # the GPU engine's iteration boundaries
        self.stage_timeout_s = stage_timeout_s
        self.desk = desk  # the GPU engine's JoinDesk: ring begins may join its steps; None: never

    def new_session(self) -> AssistSession:
        return AssistSession(self.model, self.handoff, self.gate, self.stage_timeout_s, self.desk)


class AssistSession:
    """The state of one DenseAssist stream: at most one iteration in progress.

    Each message's device work takes the device for that stage only (see the module
    doc); a gated iteration holds it from its begin to its result. Not thread-safe: the
    caller hands it one message at a time (a stream is sequential) and calls close() at
    the end. Returned tensors are on the CPU.
    """

    def __init__(self, model: Transformer, device: DeviceHandoff | threading.Lock,
                 gate: IterationGate | None = None, stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
                 desk: JoinDesk | None = None):
        self._model = model
        self._desk = desk
        self._logged_held_join = False
        self._stage_timeout_s = stage_timeout_s  # a device wait's bound when the client set no budget
        self._handoff = _as_handoff(device)
        self._lock = self._handoff.lock
        self._gate = gate if gate is not None else IterationGate()
        self._iteration: _Iteration | None = None
        self._last_iteration_id: int | None = None
        self._holding_lock = False  # a gated iteration holds the device across its stages
        self._wait_budget_s: float | None = None  # device wait left to the iteration (None: unbounded)
        self.device_wait_s = 0.0  # the current (or last) iteration's total wait for the device
        self.host_outputs = True  # False: q/k/v stay on the device (the shm ring copies them into its slot)

    @property
    def in_iteration(self) -> bool:
        """True between a begin and its result."""
        return self._iteration is not None

    @property
    def accepts_join(self) -> bool:
        """True when ring begins may join the GPU engine's steps (the server has a desk)."""
        return self._desk is not None

    @torch.inference_mode()
    def begin(self, begin: AssistBegin, channel: RemoteRowsChannel | None = None) -> AssistQkv | object:
        """Start an iteration: embed the batch, compute RoPE once, return layer 0's q, k, v.

        A begin with join_engine_iteration and a ring `channel` is offered to the engine's next
        step instead: RESULT_SENT when that step ran it
        (its result went down the ring); not taken within max_join_wait_us, it runs staged from
        here (dualpace); gated (max_join_wait_us 0) waits up to the stage timeout, then
        AssistExpired. Without a channel or a desk a join runs as if it were none: staged, or held
        when it also set wait_for_engine_iteration (gated clients do, for this downgrade)."""
        self._check_begin(begin)
        model = self._model
        self._wait_budget_s = begin.max_device_wait_ms / 1e3 if begin.max_device_wait_ms else None
        self.device_wait_s = 0.0
        if begin.join_engine_iteration:
            if channel is not None and self._desk is not None:
                if self._offer_join(begin, channel):
                    self._last_iteration_id = begin.iteration_id
                    return RESULT_SENT
            elif begin.wait_for_engine_iteration and not self._logged_held_join:
                self._logged_held_join = True  # once per stream
                log.info("gated joins on this stream run held (%s)",
                         "over gRPC: too large for the slots, or no shared memory" if self._desk is not None
                         else "this server has no join desk")
        if begin.wait_for_engine_iteration:  # gated baseline: one CPU iteration per GPU iteration
            wait_s = self._wait_budget_s if self._wait_budget_s is not None else self._stage_timeout_s
            self._gate.wait_turn(wait_s)
            # a plain acquire, not a waiting stage: the engine finishes its iteration first
            if not self._lock.acquire(timeout=wait_s):
                raise self._busy(f"the device stayed busy with the GPU engine's own step for {wait_s * 1e3:.0f} ms")
            self._holding_lock = True
        try:
            with self._device_stage():
                token_ids = torch.tensor(begin.token_ids, dtype=torch.long, device=model.device)
                positions = torch.tensor(begin.positions, dtype=torch.long, device=model.device)
                hidden = model.embed(token_ids)
                rope = model.rope_angles(positions)
                iteration = _Iteration(begin=begin, hidden=hidden, rope=rope, next_layer=0)
                qkv = self._pre_attention(iteration, 0)
        except BaseException:
            self._release()
            raise
        self._iteration = iteration
        self._last_iteration_id = begin.iteration_id
        return qkv

    @torch.inference_mode()
    def attention_output(self, message: AssistAttentionOutput) -> AssistQkv | AssistResult:
        """Finish a layer with the CPU's attention output; return the next layer's qkv or the result."""
        iteration = self._check_attention_output(message)
        model = self._model
        layer = message.layer
        try:
            with self._device_stage():
                attention_out = message.attention_output.to(device=model.device, dtype=model.dtype)
                iteration.hidden = model.post_attention(layer, iteration.hidden, attention_out)
                if layer + 1 < model.config.num_layers:
                    iteration.next_layer = layer + 1
                    return self._pre_attention(iteration, layer + 1)
                result = self._finish(iteration)
        except BaseException:
            self.close()
            raise
        self._iteration = None
        self._release()
        return result

    def _offer_join(self, begin: AssistBegin, channel: RemoteRowsChannel) -> bool:
        """Offer the begin's rows to the engine's next step: True when it ran them (result sent);
        False when not taken and dualpace (then it runs staged). Raises AssistExpired for a gated
        join not taken within the stage timeout, Overloaded for one the step dropped."""
        gated = begin.max_join_wait_us == 0
        # gated waits for the engine's step up to the stage timeout (max_device_wait_ms bounds stages only)
        max_wait_s = self._stage_timeout_s if gated else begin.max_join_wait_us / 1e6
        join = JoinRequest(begin=begin, channel=channel, offered_s=time.monotonic())
        outcome = self._desk.offer(join, max_wait_s, decline_when_late=not gated)
        if outcome is JoinOutcome.TAKEN_DONE:
            return True
        if outcome is JoinOutcome.DROPPED:
            raise Overloaded(f"the GPU engine's step dropped this joined iteration: {join.error}")
        if gated:
            raise AssistExpired(f"no GPU engine step took this gated join within the server's stage timeout "
                                f"of {max_wait_s:g} s (--assist-stage-timeout-s)")
        return False

    def close(self) -> None:
        """End the stream: drop an unfinished iteration and give the device back."""
        self._iteration = None
        self._release()

    def _release(self) -> None:
        if self._holding_lock:
            self._holding_lock = False
            self._lock.release()

    @contextmanager
    def _device_stage(self) -> Iterator[None]:
        """The device for one stage: taken through the handoff (at the engine's next layer
        boundary) unless a gated iteration already holds it. Its wait is charged to the
        iteration's budget; Overloaded when the budget runs out."""
        if self._holding_lock:
            yield
            return
        budget_s = self._wait_budget_s
        timeout_s = self._stage_timeout_s if budget_s is None else max(0.0, budget_s)
        started_s = time.monotonic()
        acquired = self._handoff.acquire_stage(timeout_s)
        waited_s = time.monotonic() - started_s
        self.device_wait_s += waited_s
        if budget_s is not None:
            self._wait_budget_s = budget_s - waited_s
        if not acquired:
            raise self._busy(f"the device stayed busy with the GPU engine's own step: this iteration waited "
                             f"{self.device_wait_s * 1e3:.0f} ms for it in all")
        try:
            yield
        finally:
            self._handoff.release_stage()

    def _busy(self, message: str) -> Overloaded | AssistExpired:
        """The client's budget ran out (it redoes the iteration locally), or the server's stage timeout."""
        if self._wait_budget_s is not None:
            return Overloaded(message)
        return AssistExpired(f"{message} (past the server's stage timeout of {self._stage_timeout_s:g} s)")

    def _pre_attention(self, iteration: _Iteration, layer: int) -> AssistQkv:
        q, k, v = self._model.pre_attention(layer, iteration.hidden, iteration.rope)
        if self.host_outputs:
            q, k, v = q.cpu(), k.cpu(), v.cpu()
        return AssistQkv(iteration_id=iteration.begin.iteration_id, layer=layer, q=q, k=k, v=v)

    def _finish(self, iteration: _Iteration) -> AssistResult:
        """Logits, then sampling when asked (result_from_logits); a begin that asked to join and ran
        staged says so in its join info."""
        begin = iteration.begin
        info = AssistJoinInfo(how=JoinHow.STAGED) if begin.join_engine_iteration else None
        return result_from_logits(begin, self._model.logits(iteration.hidden), info)

    # ---- validation (before any device work) ----------------------------

    def _check_begin(self, begin: AssistBegin) -> None:
        if self._iteration is not None:
            current = self._iteration
            raise InvalidArgument(
                "begin",
                f"iteration {current.begin.iteration_id} is still in progress "
                f"(expected attention_output for layer {current.next_layer})",
            )
        if self._last_iteration_id is not None and begin.iteration_id <= self._last_iteration_id:
            raise InvalidArgument(
                "begin.iteration_id",
                f"{begin.iteration_id} must be greater than the previous iteration's {self._last_iteration_id}",
            )
        num_rows = len(begin.token_ids)
        if num_rows == 0:
            raise InvalidArgument("begin.token_ids", "must not be empty")
        if len(begin.positions) != num_rows:
            raise InvalidArgument(
                "begin.positions", f"has {len(begin.positions)} entries but token_ids has {num_rows}"
            )
        vocab_size = self._model.config.vocab_size
        for row, token_id in enumerate(begin.token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(
                    f"begin.token_ids[{row}]", f"{token_id} is outside the vocabulary [0, {vocab_size})"
                )
        if begin.sampling is not None:
            self._check_sampling(begin.sampling, num_rows, vocab_size)

    @staticmethod
    def _check_sampling(sampling: list[tuple[SamplingParams, int]], num_rows: int, vocab_size: int) -> None:
        if len(sampling) != num_rows:
            raise InvalidArgument(
                "begin.sampling",
                f"has {len(sampling)} entries but the batch has {num_rows} rows (or set return_logits)",
            )
        for row, (params, seed) in enumerate(sampling):
            try:
                replace(params, seed=seed).validate(vocab_size)
            except InvalidArgument as exc:
                raise InvalidArgument(f"begin.sampling[{row}].{exc.field}", exc.problem) from None
            if has_penalties(params) or params.logprobs is not None or params.prompt_logprobs is not None:
                # They need the request's tokens, which stay on the CPU engine: it asks for logits instead.
                raise InvalidArgument(f"begin.sampling[{row}]", "penalties, logit_bias, min_tokens and logprobs "
                                      "are applied by the CPU engine: set return_logits for such rows")

    def _check_attention_output(self, message: AssistAttentionOutput) -> _Iteration:
        iteration = self._iteration
        if iteration is None:
            raise InvalidArgument("attention_output", "no iteration is in progress; send begin first")
        if message.iteration_id != iteration.begin.iteration_id:
            raise InvalidArgument(
                "attention_output.iteration_id",
                f"is {message.iteration_id} but the iteration in progress is {iteration.begin.iteration_id}",
            )
        if message.layer != iteration.next_layer:
            raise InvalidArgument(
                "attention_output.layer", f"is {message.layer} but layer {iteration.next_layer} is expected next"
            )
        config = self._model.config
        expected_shape = [len(iteration.begin.token_ids), config.num_heads * config.head_dim]
        actual_shape = list(message.attention_output.shape)
        if actual_shape != expected_shape:
            raise InvalidArgument(
                "attention_output.attention_output",
                f"shape {actual_shape} does not match the expected [batch, num_heads * head_dim] = {expected_shape}",
            )
        return iteration
