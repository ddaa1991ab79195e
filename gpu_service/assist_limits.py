"""Server-side bounds on Dense Assist sessions, so that a stalled or slow CPU engine cannot
stall gpu_service.

- idle timeout (`--assist-idle-timeout-s`): the longest the server waits for the client's next
  message while an iteration is in progress. The session holds the iteration's residual stream
  then, and a gated iteration (the NEO-like baseline) holds the device lock from its begin to
  its result, so a client that stops sending mid-iteration would otherwise keep the engine's
  steps from running. On expiry the stream ends with DEADLINE_EXCEEDED and the session is closed
  (the lock released). Between iterations a stream may idle as long as it likes: it holds nothing.
- stage timeout (`--assist-stage-timeout-s`): the longest one stage may take, its waits for the
  device (the engine's iteration boundary for a gated begin, the engine's next layer otherwise)
  included, when the client set no budget of its own (max_device_wait_ms). On expiry:
  DEADLINE_EXCEEDED; the client redoes the iteration locally.
- transport (`--assist-transport`): auto accepts a same-host client's shared-memory segment
  (gpu_service/assist_shm_session.py) and answers any other client with the TCP data socket; tcp
  answers every client with the data socket. At most --assist-max-shm-streams streams at once,
  each served by a thread of its own; past that an offer is refused (the client runs locally).
- join layer wait (`--assist-join-min-layer-wait-ms`): the least time the GPU engine's step waits
  for a joined iteration's attention output of one layer before it drops the join (the bound is
  max(this, 2 x the begin's expected_layer_us), dualpace.policy.cooperative_plan.join_wait_bound_ms);
  the dropped iteration ends RESOURCE_EXHAUSTED and the CPU redoes it locally, so a stalled CPU
  costs the GPU's own rows at most one bound, once.
- joins (`--assist-join`): on lets ring begins join the GPU engine's steps (the shm answer says
  accepts_join); off serves every iteration in stages, as older servers do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dualpace.engine.assist.joined_step import DEFAULT_JOIN_MIN_LAYER_WAIT_MS
from dualpace.errors import DualPaceError, InvalidArgument

DEFAULT_IDLE_TIMEOUT_S = 5.0
DEFAULT_STAGE_TIMEOUT_S = 5.0
DEFAULT_MAX_SHM_STREAMS = 16
TRANSPORTS = ("auto", "tcp")  # as cpu_service's --assist-transport


class AssistExpired(DualPaceError):
    """A session or stage ran past its server-side timeout (gRPC DEADLINE_EXCEEDED)."""


def idle_expired(idle_timeout_s: float) -> AssistExpired:
    return AssistExpired(f"the client sent nothing for {idle_timeout_s:g} s in the middle of an iteration "
                         f"(--assist-idle-timeout-s); the session is closed")


def stage_expired(stage_timeout_s: float) -> AssistExpired:
    return AssistExpired(f"a stage ran past the server's stage timeout of {stage_timeout_s:g} s "
                         f"(--assist-stage-timeout-s)")


@dataclass(frozen=True)
class AssistLimits:
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S
    shm_enabled: bool = True  # --assist-transport auto
    max_shm_streams: int = DEFAULT_MAX_SHM_STREAMS
    join_min_layer_wait_ms: float = DEFAULT_JOIN_MIN_LAYER_WAIT_MS
    join_enabled: bool = True

    def __post_init__(self) -> None:
        for flag, value in (("--assist-idle-timeout-s", self.idle_timeout_s),
                            ("--assist-stage-timeout-s", self.stage_timeout_s)):
            if not value > 0:
                raise InvalidArgument(flag, f"must be > 0, got {value}")
        if not self.join_min_layer_wait_ms > 0:
            raise InvalidArgument("--assist-join-min-layer-wait-ms", f"must be > 0, got {self.join_min_layer_wait_ms}")
        if self.max_shm_streams < 0:
            raise InvalidArgument("--assist-max-shm-streams", f"must be >= 0, got {self.max_shm_streams}")


def add_assist_limit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--assist-idle-timeout-s", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                        help="Dense Assist: end a session (DEADLINE_EXCEEDED, device lock released) whose client "
                             "sends nothing for this long in the middle of an iteration")
    parser.add_argument("--assist-stage-timeout-s", type=float, default=DEFAULT_STAGE_TIMEOUT_S,
                        help="Dense Assist: the longest one stage may wait for the device and run, when the "
                             "client set no max_device_wait_ms (then DEADLINE_EXCEEDED)")
    parser.add_argument("--assist-transport", default="auto", choices=TRANSPORTS,
                        help="Dense Assist: auto accepts a same-host client's shared memory, else answers with the "
                             "TCP data socket; tcp: the data socket for every client")
    parser.add_argument("--assist-max-shm-streams", type=int, default=DEFAULT_MAX_SHM_STREAMS,
                        help="Dense Assist: the most streams served at once (through shared memory or the data socket)")
    parser.add_argument("--assist-join", default="on", choices=["on", "off"],
                        help="Dense Assist: on lets a same-host CPU engine's iterations join this engine's steps "
                             "(one weight read for both); off: every iteration in stages of its own")
    parser.add_argument("--assist-join-min-layer-wait-ms", type=float, default=DEFAULT_JOIN_MIN_LAYER_WAIT_MS,
                        help="Dense Assist: the least time a step waits for a joined iteration's attention of one "
                             "layer before it drops the join (the CPU then redoes that iteration locally)")


def limits_from_args(args: argparse.Namespace) -> AssistLimits:
    return AssistLimits(args.assist_idle_timeout_s, args.assist_stage_timeout_s,
                        shm_enabled=args.assist_transport == "auto", max_shm_streams=args.assist_max_shm_streams,
                        join_min_layer_wait_ms=args.assist_join_min_layer_wait_ms,
                        join_enabled=args.assist_join == "on")
