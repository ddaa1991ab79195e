"""A joined iteration's exchange over its stream's shared-memory ring (the RemoteRowsChannel of
dualpace/engine/assist/join_desk.py).

When a ring begin asks to join the GPU engine's step, the stream's thread hands the join to the
JoinDesk and waits there; the engine's step thread then drives the iteration through this
channel: each layer's q/k/v go down the ring as they would from a stage, the CPU's attention
output comes up, and after the last layer the join's logits rows are sampled here exactly as a
staged iteration's are (`result_from_logits`) and the result slot goes down carrying the
AssistJoinInfo bytes as its payload. The stream's thread does no ring I/O meanwhile (it is
blocked in the desk), so each ring keeps one reader and one writer.

The CPU it talks to sees the same exchange as for a staged iteration: begin, qkv(0),
attention_output(0), ..., result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from dualpace.engine.assist import ring_pacing
from dualpace.engine.assist.assist_types import AssistBegin, AssistJoinInfo, AssistResult, JoinHow, ShmSlotKind
from dualpace.engine.assist.shm_ring import ShmEndpoint, ShmProtocolError, SlotMessage
from dualpace.model.transformer import Transformer
from dualpace.sampling import sample_next_tokens
from dualpace.wire import assist_messages

log = logging.getLogger(__name__)

_HOW_BY_NAME = {"joined": JoinHow.JOINED, "split": JoinHow.SPLIT, "staged": JoinHow.STAGED}


def result_from_logits(begin: AssistBegin, logits: torch.Tensor, join_info: AssistJoinInfo | None = None
                       ) -> AssistResult:
    """An iteration's result from its final logits [batch, vocab]: sampled when the begin asked the
    server to sample, else the logits. A row with non-finite logits cannot be named by a token id,
    so then the logits are returned instead and the client samples (and sees which rows failed)."""
    if begin.sampling is None:
        return AssistResult(iteration_id=begin.iteration_id, logits=logits.cpu(), join_info=join_info)
    params = [params for params, _ in begin.sampling]
    seeds = [seed for _, seed in begin.sampling]
    sample_positions = [position + 1 for position in begin.positions]
    sampled = sample_next_tokens(logits, params, seeds, sample_positions)
    if not all(sampled.finite):
        return AssistResult(iteration_id=begin.iteration_id, logits=logits.cpu(), join_info=join_info)
    return AssistResult(iteration_id=begin.iteration_id, token_ids=sampled.token_ids, join_info=join_info)


def send_result(endpoint: ShmEndpoint, result: AssistResult, put_on_stream: Callable[[object], None]) -> None:
    """The result slot (token ids, or logits when they fit), its payload the join info's bytes; a
    result too large for a slot goes on the gRPC stream (`put_on_stream(AssistDown)`) and the slot says so."""
    payload = assist_messages.join_info_to_bytes(result.join_info) if result.join_info is not None else b""
    if result.token_ids is not None:
        tokens = torch.tensor(result.token_ids, dtype=torch.int64)
        endpoint.send(SlotMessage(ShmSlotKind.RESULT_TOKENS, result.iteration_id, 0, [tokens], payload))
    elif endpoint.fits([result.logits.numel() * 4], len(payload)):
        endpoint.send(SlotMessage(ShmSlotKind.RESULT_LOGITS, result.iteration_id, 0, [result.logits.float()],
                                  payload))
    else:
        put_on_stream(assist_messages.assist_down_to_pb(result))
        endpoint.send(SlotMessage(ShmSlotKind.RESULT_ON_STREAM, result.iteration_id, 0, [], payload))


def join_info_from_step(info) -> AssistJoinInfo:
    """The desk's JoinStepInfo (how: "joined" | "split") as the wire's AssistJoinInfo."""
    return AssistJoinInfo(how=_HOW_BY_NAME.get(str(info.how), JoinHow.UNSPECIFIED),
                          engine_step_id=int(info.engine_step_id), gpu_wait_us=int(info.gpu_wait_us),
                          step_start_ns=int(info.step_start_ns), step_end_ns=int(info.step_end_ns))


class RingJoinChannel:
    """One joined iteration's RemoteRowsChannel over the stream's own (server side, "down") endpoint.

    Called from the engine's step thread only, while the stream's thread waits in the desk.
    `stopped()` is true once the stream is ending (its stop() also interrupts the ring's wait),
    so a receive for a CPU that is gone returns None at once.

    The CPU's answer of each layer carries when it saw the q/k/v and when it answered (dualpace/engine/assist/ring_pacing.py): `marks` sums where the round trips went."""

    def __init__(self, endpoint: ShmEndpoint, model: Transformer, begin: AssistBegin,
                 stopped: Callable[[], bool], put_on_stream: Callable[[object], None], peer: str = ""):
        self._endpoint = endpoint
        self.marks = ring_pacing.LayerMarks()
        self._sent_ns = 0
        self.peer = peer  # the CPU engine's stream, as step timelines name the join's peer
        self._model = model
        self._begin = begin
        self._stopped = stopped
        self._put_on_stream = put_on_stream
        self._num_rows = len(begin.token_ids)
        config = model.config
        self._attention_width = config.num_heads * config.head_dim
        self.error: BaseException | None = None  # what fail() was called with, or a protocol error seen here
        self.result: AssistResult | None = None  # what finish() sent
        self.num_layers_sent = 0

    def send_qkv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._sent_ns = time.monotonic_ns()
        self._endpoint.send_parts(ShmSlotKind.QKV, self._begin.iteration_id, layer, (q, k, v))
        self.num_layers_sent = layer + 1

    def receive_attention(self, layer: int, deadline_s: float) -> torch.Tensor | None:
        """The CPU's attention output of `layer` on the model's device, or None: past the deadline, the
        stream ending, or a slot that is not that layer's attention output (recorded in `error`)."""
        endpoint, marks = self._endpoint, self.marks
        wait_start_ns = time.monotonic_ns()
        sleeps_before = endpoint.incoming.num_sleeps
        try:
            message = endpoint.receive(deadline_s, self._stopped)
        except ShmProtocolError as exc:
            self.error = exc
            return None
        finally:
            marks.num_sleeps += endpoint.incoming.num_sleeps - sleeps_before
        if message is None:
            return None
        stamp = ring_pacing.output_stamp(message.payload)
        if stamp is not None:
            marks.add(self._sent_ns, wait_start_ns, time.monotonic_ns(), stamp)
        expected_shape = [self._num_rows, self._attention_width]
        if (message.kind != ShmSlotKind.ATTENTION_OUTPUT or message.iteration_id != self._begin.iteration_id
                or message.layer != layer or len(message.tensors) != 1
                or list(message.tensors[0].shape) != expected_shape):
            self.error = ShmProtocolError(
                f"slot: expected the attention output {expected_shape} of iteration {self._begin.iteration_id} "
                f"layer {layer}, got kind {message.kind} for iteration {message.iteration_id} layer {message.layer}")
            return None
        return message.tensors[0].to(device=self._model.device, dtype=self._model.dtype)

    @torch.inference_mode()
    def finish(self, logits_rows: torch.Tensor, info) -> None:
        """Sample (or return) the join's logits rows and send the result slot with how the step ran."""
        result = result_from_logits(self._begin, logits_rows, join_info_from_step(info))
        send_result(self._endpoint, result, self._put_on_stream)
        self.result = result

    def fail(self, error: BaseException) -> None:
        """The step will not finish this join: the session raises (the CPU redoes the iteration locally)."""
        if self.error is None:
            self.error = error
        log.info("a joined assist iteration was dropped: %s", error)
