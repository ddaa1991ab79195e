"""When a cooperative CPU iteration (dualpace policy) joins a busy GPU engine's step: the join rule
(docs/design_cooperative_execution.md, section 11).

Remote rows can share a weight read with the GPU's own rows only at the same layer index, so a row
cannot enter a running step at layer l > 0 with its layer 0. The rules differ in what the CPU does
until a step can take its rows; each keeps the CPU's clock from waiting beyond one GPU layer, or
(SLACK) beyond what the wait saves it:

- WITHIN_A_LAYER (as designed first): ask only when the GPU's next step begins within one GPU
  layer; otherwise the iteration runs staged (its own dense pass per layer at the step's layer
  boundaries).
- MEET: the CPU starts its iteration locally at once; its rows join a GPU step (the running one or
  a later one) from the first layer k at which the step's layer clock meets the CPU's: the CPU has
  run layers 0..k-1 locally and is ready no later than the step begins layer k, and waits at most
  one GPU layer there. Layers k.. are shared (one weight read for both engines), the iteration ends
  with the step. It joins only where that ends the iteration sooner than running on locally, so it
  never costs the CPU time; where no step meets it, the iteration simply finishes locally.
- MEET_NET: MEET, joining only where the tokens per ms the CPU gains (its rows, sooner) exceed those
  the GPU loses (its own rows, each joined layer longer): the shared read must pay for itself.
- SLACK: wait for the next step while the wait is within the CPU's slack (its local estimate minus
  its cooperative one: ModeChooser.max_join_wait_ms), else run locally. The CPU may idle longer
  than a layer, but never longer than the local iteration would have taken over the joined one.

Pure (no torch, grpc, asyncio or clock): times are given, in ms, relative to the CPU iteration's
start unless a name says otherwise.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

_EPS_MS = 1e-9


class JoinRule(str, enum.Enum):
    WITHIN_A_LAYER = "within-layer"
    MEET = "meet"
    MEET_NET = "meet-net"
    SLACK = "slack"


class JoinAction(str, enum.Enum):
    JOIN_NEXT_STEP = "join-next-step"  # offer the rows to the next step from its layer 0
    MEET = "meet"  # start locally, join where a step's layer clock meets the CPU's (meeting_point)
    STAGED = "staged"  # run the iteration staged at the running step's layer boundaries
    LOCAL = "local"  # run the iteration locally


def join_rule(value: JoinRule | str) -> JoinRule:
    try:
        return JoinRule(value)
    except ValueError:
        names = ", ".join(r.value for r in JoinRule)
        raise ValueError(f"join rule must be one of {names}, got {value!r}") from None


def join_action(rule: JoinRule | str, wait_ms: float | None, gpu_layer_ms: float, slack_ms: float) -> JoinAction:
    """What a cooperative iteration does when it starts. wait_ms: until the GPU's next step begins
    (0: the GPU starts one now; None: the GPU has nothing to run, no step is coming); gpu_layer_ms:
    the running step's layer time (0 when none runs); slack_ms: the CPU's slack
    (ModeChooser.max_join_wait_ms)."""
    chosen = join_rule(rule)
    if wait_ms is not None and wait_ms <= gpu_layer_ms + _EPS_MS:
        return JoinAction.JOIN_NEXT_STEP  # within one layer: every rule joins from layer 0
    if chosen is JoinRule.WITHIN_A_LAYER:
        return JoinAction.STAGED
    if chosen in (JoinRule.MEET, JoinRule.MEET_NET):
        return JoinAction.MEET
    return JoinAction.JOIN_NEXT_STEP if wait_ms is not None and wait_ms <= slack_ms else JoinAction.LOCAL


@dataclass(frozen=True)
class MeetingPoint:
    layer: int  # the first layer whose weight read the remote rows share (layers 0..layer-1 ran locally)
    cpu_wait_ms: float  # the CPU's wait at that boundary (at most one GPU layer)
    end_ms: float  # the iteration's predicted end: the step's end with the rows on board


@dataclass(frozen=True)
class TokenRates:
    """MEET_NET's trade: the step's own sampled rows and length without the join, the CPU's rows."""

    gpu_rows: int
    gpu_step_ms: float
    cpu_rows: int

    def join_pays(self, joined_end_ms: float, cpu_local_ms: float, gpu_extra_ms: float) -> bool:
        """The CPU's rows gain more tokens per ms (ending at joined_end_ms, not cpu_local_ms) than the
        step's own rows lose (the step gpu_extra_ms longer)."""
        if joined_end_ms <= 0 or self.gpu_step_ms <= 0:
            return joined_end_ms < cpu_local_ms
        cpu_gain = self.cpu_rows * (1.0 / joined_end_ms - 1.0 / cpu_local_ms)
        gpu_loss = self.gpu_rows * (1.0 / self.gpu_step_ms - 1.0 / (self.gpu_step_ms + gpu_extra_ms))
        return cpu_gain > gpu_loss


def meeting_point(gpu_layer0_ms: float, gpu_layer_ms: float, joined_extra_layer_ms: float, cpu_layer_ms: float,
                  num_layers: int, cpu_local_ms: float, cpu_done_layers: int = 0,
                  rates: TokenRates | None = None, max_step_ms: float | None = None,
                  own_step_ms: float = 0.0) -> MeetingPoint | None:
    """Where a locally running CPU iteration meets a GPU step (rule MEET).

    The step's layer j begins at gpu_layer0_ms + j x gpu_layer_ms (negative for a step already
    running) and, with the remote rows on board, each of its remaining layers takes
    joined_extra_layer_ms more; the CPU is ready for layer k at k x cpu_layer_ms and has already
    passed cpu_done_layers layers. The rows join at the first layer k >= cpu_done_layers, below
    num_layers, that the CPU reaches no later than the step begins it, with at most one GPU layer
    of wait, where joining ends the iteration sooner than finishing locally (cpu_local_ms) and,
    given `rates` (MEET_NET), where the join pays for the GPU time it adds; given max_step_ms (the
    ITL target), where the step (own_step_ms without the join) stays within it with the join, so
    the GPU's own rows keep their target; None when there is no such layer."""
    if num_layers < 1 or not (gpu_layer_ms >= 0 and cpu_layer_ms >= 0 and joined_extra_layer_ms >= 0):
        raise ValueError("meeting_point needs num_layers >= 1 and layer times >= 0")
    if not (math.isfinite(gpu_layer0_ms) and math.isfinite(cpu_local_ms)):
        raise ValueError("meeting_point needs finite times")
    for layer in range(max(0, cpu_done_layers), num_layers):
        gpu_begins_ms = gpu_layer0_ms + layer * gpu_layer_ms
        wait_ms = gpu_begins_ms - layer * cpu_layer_ms
        if wait_ms < -_EPS_MS:
            continue  # the step is past this layer when the CPU gets there
        if wait_ms > gpu_layer_ms + _EPS_MS:
            continue  # the CPU would wait more than a GPU layer: it runs on locally
        end_ms = gpu_begins_ms + (num_layers - layer) * (gpu_layer_ms + joined_extra_layer_ms)
        if end_ms >= cpu_local_ms - _EPS_MS:
            continue  # no faster than running on locally (a later layer adds less joined time)
        gpu_extra_ms = (num_layers - layer) * joined_extra_layer_ms
        if max_step_ms is not None and own_step_ms + gpu_extra_ms > max_step_ms:
            continue
        if rates is not None and not rates.join_pays(end_ms, cpu_local_ms, gpu_extra_ms):
            continue
        return MeetingPoint(layer, max(0.0, wait_ms), end_ms)
    return None
