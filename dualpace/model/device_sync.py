"""Waiting for a device's queued work, so that timings and hand-offs follow the work, not its launch.

On CUDA a kernel launch returns before the kernel runs. A step that samples nothing (a prefill
chunk before the prompt's end) would otherwise return with its work still queued, and its device
time would be billed to the next step's latency; and the device hand-off to a Dense Assist stage
would happen once the engine's layer was launched, so the stage would queue behind it. These
functions wait on a CUDA event recorded on the current stream; elsewhere they return at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _nothing_queued() -> None:
    return None


def work_finisher(device: torch.device) -> Callable[[], None]:
    """A function that returns once the work queued so far on `device`'s current stream is done."""
    if device.type != "cuda":
        return _nothing_queued

    def wait_for_queued_work() -> None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()

    return wait_for_queued_work
