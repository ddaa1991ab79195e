"""Per-layer pacing of a joined iteration's ring: when to expect the peer's next message, and
where each layer's round trip went (docs/design_cooperative_execution.md, section 4).

Each side stamps the messages it sends with CLOCK_MONOTONIC (`time.monotonic_ns`, one clock for
every process of the host) in the slot's payload, which older peers ignore:

- the GPU's q/k/v of a layer carry when it posted them (`QKV_STAMP`);
- the CPU's attention output carries when it saw those q/k/v and when it posted the output
  (`OUTPUT_STAMP`).

With them the GPU side splits each layer's round trip (`LayerMarks`): the hop down (its post
until the CPU's receive returned: the doorbell, the CPU thread's wake-up, its GIL), the CPU's
own time for the layer (KV write, attention), the part of its own wait before the CPU had posted,
and the hop up (the CPU's post until its own receive returned: its wake-up).

`AnswerPredictor` sets how long a wait first spins without yielding (`Doorbell.wait`'s
busy_spin_s), from the interval the previous layers took between a send and the peer's answer:
a waiter that expects its answer within a few hundred microseconds keeps its core and looks,
instead of yielding it (on a busy core a sched_yield hands the core to another task for up to a
scheduler slice) or sleeping and paying a wake-up. The busy spin is bounded (`MAX_BUSY_SPIN_S`),
then the doorbell's own yielding spin and futex sleep follow, so a late peer costs one bounded
spin.
Pure arithmetic on nanosecond stamps the caller takes: no clock here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

QKV_STAMP = struct.Struct("=q")  # the GPU's post of a layer's q/k/v (monotonic ns)
OUTPUT_STAMP = struct.Struct("=qq")  # the CPU: q/k/v seen, attention output posted (monotonic ns)
MAX_BUSY_SPIN_S = 1e-3  # the longest busy spin (a layer here is ~0.3-1 ms; a late peer costs this once)
SPIN_MARGIN_S = 150e-6  # spin this long past the predicted answer (its jitter)
EMA_WEIGHT = 0.3  # weight of the newest interval


def qkv_stamp(payload: bytes) -> int | None:
    return QKV_STAMP.unpack(payload)[0] if len(payload) == QKV_STAMP.size else None


def output_stamp(payload: bytes) -> tuple[int, int] | None:
    return OUTPUT_STAMP.unpack(payload) if len(payload) == OUTPUT_STAMP.size else None


class AnswerPredictor:
    """How long after this side's send the peer's answer is posted (an EMA over layers), and the
    busy spin a wait for it should start with."""

    def __init__(self) -> None:
        self.expected_ns = 0  # 0: nothing observed yet

    def observe(self, interval_ns: int) -> None:
        if interval_ns <= 0:
            return
        previous = self.expected_ns
        self.expected_ns = interval_ns if not previous else round(
            (1 - EMA_WEIGHT) * previous + EMA_WEIGHT * interval_ns)

    def busy_spin_s(self, sent_ns: int, now_ns: int) -> float:
        """The busy spin for a wait that starts at now_ns for the answer to a send at sent_ns: until
        the predicted answer and a margin, at most MAX_BUSY_SPIN_S; 0 before any observation."""
        if not self.expected_ns:
            return 0.0
        remaining_s = (sent_ns + self.expected_ns - now_ns) / 1e9
        return min(MAX_BUSY_SPIN_S, max(0.0, remaining_s + SPIN_MARGIN_S))


@dataclass
class LayerMarks:
    """Σ over the layers of one or more joins (GPU side): see the module's docstring."""

    num_layers: int = 0  # layers whose answer carried the CPU's stamps
    down_hop_ns: int = 0
    cpu_layer_ns: int = 0
    wait_before_answer_ns: int = 0
    up_hop_ns: int = 0
    num_sleeps: int = 0  # the GPU's waits that went to the futex (all layers, stamped or not)

    def add(self, sent_ns: int, wait_start_ns: int, received_ns: int, stamp: tuple[int, int] | None) -> None:
        if stamp is None:
            return
        seen_ns, posted_ns = stamp
        self.num_layers += 1
        self.down_hop_ns += max(0, seen_ns - sent_ns)
        self.cpu_layer_ns += max(0, posted_ns - seen_ns)
        self.wait_before_answer_ns += max(0, min(posted_ns, received_ns) - wait_start_ns)
        self.up_hop_ns += max(0, received_ns - max(wait_start_ns, posted_ns))

    def merge(self, other: LayerMarks) -> None:
        for name in ("num_layers", "down_hop_ns", "cpu_layer_ns", "wait_before_answer_ns", "up_hop_ns",
                     "num_sleeps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def record_fields(self) -> dict:
        """As StepRecord fields (dualpace/engine/step_timeline.py)."""
        return {"num_marked_layers": self.num_layers, "down_hop_ns": self.down_hop_ns,
                "cpu_layer_ns": self.cpu_layer_ns, "wait_before_answer_ns": self.wait_before_answer_ns,
                "up_hop_ns": self.up_hop_ns, "num_wait_sleeps": self.num_sleeps}
