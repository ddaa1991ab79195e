"""The CPU engine's side of cooperative execution: what a begin asks of the GPU engine's step.

A begin with `join_engine_iteration` asks gpu_service to run its dense rows inside the GPU
engine's next step; the exchange the client sees is the
same as for a staged iteration. Only servers that answered the stream's shared-memory offer with
`accepts_join` are asked: for any other (an older server, a stream over gRPC only, a batch too
large for the slots) the join fields are dropped here and the iteration runs as before, staged
or, for a gated client (which also sets wait_for_engine_iteration), held; that downgrade is logged
once per client.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dualpace.engine.assist.assist_types import AssistBegin, AssistJoinInfo, JoinHow
from dualpace.serve.logging_setup import get_logger

log = get_logger(__name__)
MIN_JOIN_WAIT_US = 1  # 0 on the wire means "up to the server's stage timeout" (gated)
MAX_JOIN_WAIT_US = 2**32 - 1  # the wire's uint32


@dataclass(frozen=True)
class JoinAsk:
    """What one iteration asks: join or not, how long it may wait for the GPU step to begin
    (None: as long as the server allows, the gated policy), and its measured time per layer."""

    join: bool = False
    max_join_wait_us: int | None = None
    expected_layer_us: int = 0

    @classmethod
    def dualpace(cls, max_join_wait_ms: float, expected_layer_us: int = 0) -> JoinAsk:
        """A join that waits at most its slack for the step (never 0: that would mean gated)."""
        wait_us = min(MAX_JOIN_WAIT_US, max(MIN_JOIN_WAIT_US, round(max_join_wait_ms * 1e3)))
        return cls(True, wait_us, min(MAX_JOIN_WAIT_US, max(0, expected_layer_us)))

    @classmethod
    def gated(cls, expected_layer_us: int = 0) -> JoinAsk:
        return cls(True, None, expected_layer_us)


NO_JOIN = JoinAsk()


class JoinDowngrades:
    """Drops the join fields of begins a peer cannot join, logging the first gated downgrade."""

    def __init__(self, address: str):
        self._address = address
        self.num_downgraded = 0

    def begin_for_peer(self, begin: AssistBegin, accepts_join: bool) -> AssistBegin:
        if not begin.join_engine_iteration or accepts_join:
            return begin
        self.num_downgraded += 1
        if self.num_downgraded == 1 and begin.wait_for_engine_iteration:
            log.warning("gated: the GPU server cannot join this stream's iterations into its steps (an older "
                        "server, or no shared memory); they run held instead", address=self._address)
        return replace(begin, join_engine_iteration=False, max_join_wait_us=0, expected_layer_us=0)


def ran_in_engine_step(info: AssistJoinInfo | None) -> bool:
    """True when the iteration's rows rode in the GPU engine's own step (joined or split)."""
    return info is not None and info.how in (JoinHow.JOINED, JoinHow.SPLIT)
