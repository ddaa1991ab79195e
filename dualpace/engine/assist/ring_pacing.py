"""Where each layer's ring round trip of a joined iteration went, from CLOCK_MONOTONIC stamps
(`time.monotonic_ns`, one clock for every process of the host; checked on this host: a stamp taken
on one core and read on the other is sub-µs apart): the CPU's attention output carries, in the
slot's payload (which older servers ignore), when it saw the layer's q/k/v and when it posted the
output (`OUTPUT_STAMP`); the GPU side knows when it posted the q/k/v, when it began to wait and when
its receive returned.

With them the GPU side splits each layer's round trip (`LayerMarks`): the hop down (its post
until the CPU's receive returned: the doorbell, the CPU thread's wake-up, its GIL), the CPU's
own time for the layer (KV write, attention), the part of its own wait before the CPU had posted,
and the hop up (the CPU's post until its own receive returned: its wake-up).

Pure arithmetic on nanosecond stamps the caller takes: no clock here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

OUTPUT_STAMP = struct.Struct("=qq")  # the CPU: q/k/v seen, attention output posted (monotonic ns)
LONG_WAIT_NS = 1_000_000  # a layer wait this long is counted apart (the tail that makes the sum)


def output_stamp(payload: bytes) -> tuple[int, int] | None:
    return OUTPUT_STAMP.unpack(payload) if len(payload) == OUTPUT_STAMP.size else None


@dataclass
class LayerMarks:
    """Σ over the layers of one or more joins (GPU side): see the module's docstring."""

    num_layers: int = 0  # layers whose answer carried the CPU's stamps
    down_hop_ns: int = 0
    cpu_layer_ns: int = 0
    wait_before_answer_ns: int = 0
    up_hop_ns: int = 0
    num_sleeps: int = 0  # the GPU's waits that went to the futex (all layers, stamped or not)
    num_long_waits: int = 0  # stamped layers whose GPU wait lasted LONG_WAIT_NS or more
    long_wait_ns: int = 0  # Σ of those waits

    def add(self, sent_ns: int, wait_start_ns: int, received_ns: int, stamp: tuple[int, int] | None) -> None:
        if stamp is None:
            return
        seen_ns, posted_ns = stamp
        self.num_layers += 1
        self.down_hop_ns += max(0, seen_ns - sent_ns)
        self.cpu_layer_ns += max(0, posted_ns - seen_ns)
        self.wait_before_answer_ns += max(0, min(posted_ns, received_ns) - wait_start_ns)
        self.up_hop_ns += max(0, received_ns - max(wait_start_ns, posted_ns))
        if received_ns - wait_start_ns >= LONG_WAIT_NS:
            self.num_long_waits += 1
            self.long_wait_ns += received_ns - wait_start_ns

    def merge(self, other: LayerMarks) -> None:
        for name in ("num_layers", "down_hop_ns", "cpu_layer_ns", "wait_before_answer_ns", "up_hop_ns",
                     "num_sleeps", "num_long_waits", "long_wait_ns"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def record_fields(self) -> dict:
        """As StepRecord fields (dualpace/engine/step_timeline.py)."""
        return {"num_marked_layers": self.num_layers, "down_hop_ns": self.down_hop_ns,
                "cpu_layer_ns": self.cpu_layer_ns, "wait_before_answer_ns": self.wait_before_answer_ns,
                "up_hop_ns": self.up_hop_ns, "num_wait_sleeps": self.num_sleeps,
                "num_long_waits": self.num_long_waits, "long_wait_ns": self.long_wait_ns}
