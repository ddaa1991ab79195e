"""KV rows between the device and the host for export and import (migration, the host tier),
through pinned staging memory and `non_blocking` copies on a side stream, synchronised by events.

On CUDA, `gather_to_host` waits (on the device, by an event) for the work queued so far on the
caller's stream, gathers the rows and copies them into pinned host tensors on its own stream, and
returns once that stream's event says the copy is done: the copy engine moves the bytes at the
pinned rate while the engine's steps keep the compute units busy. `to_device` stages host rows
in pinned memory, copies them up on the side stream, and makes the caller's stream wait for that
copy (an event) before anything it queues next reads them. Pinned tensors come from torch's
caching host allocator, which hands a block out again only once the copies that used it are done;
calls may come from several worker threads at once.

Elsewhere (a CPU pool) there is nothing to stage: the rows are gathered and returned as they are.
"""

from __future__ import annotations

import torch


class HostCopies:
    """Device<->host copies of KV rows for one device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._side_stream = None  # made on first use (a CUDA stream needs the device initialised)

    @property
    def staged(self) -> bool:
        """Whether copies go through pinned memory on a side stream (CUDA), or are plain (elsewhere)."""
        return self.device.type == "cuda"

    def _stream(self):
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def gather_to_host(self, flat_caches: list[torch.Tensor], index: torch.Tensor) -> list[torch.Tensor]:
        """Rows `index` of each [slots, ...] cache, as CPU tensors (pinned on CUDA), their copies done."""
        if not self.staged:
            return [cache.index_select(0, index) for cache in flat_caches]
        caller, side = torch.cuda.current_stream(self.device), self._stream()
        queued = torch.cuda.Event()
        queued.record(caller)  # the caller's writes to these rows are queued before this
        with torch.cuda.stream(side):
            side.wait_event(queued)
            device_index = index.to(self.device, non_blocking=True)  # `index` pinned: an async copy
            rows = [cache.index_select(0, device_index) for cache in flat_caches]
            host = [torch.empty(r.shape, dtype=r.dtype, pin_memory=True) for r in rows]
            for target, source in zip(host, rows):
                target.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        copied.synchronize()  # `rows` (side-stream memory) stays referenced until here
        return host

    def to_device(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Host tensors on the device in `dtype`, ready for whatever the caller's stream queues next."""
        if not self.staged:
            return [t.to(device=self.device, dtype=dtype) for t in tensors]
        caller, side = torch.cuda.current_stream(self.device), self._stream()
        staged = [torch.empty(t.shape, dtype=dtype, pin_memory=True).copy_(t) for t in tensors]
        with torch.cuda.stream(side):
            on_device = [t.to(self.device, non_blocking=True) for t in staged]
            copied = torch.cuda.Event()
            copied.record(side)
        caller.wait_event(copied)
        for t in on_device:
            t.record_stream(caller)  # made on the side stream, used on the caller's: freed only after that use
        return on_device
