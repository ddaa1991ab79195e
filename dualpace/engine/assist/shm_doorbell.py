"""A doorbell in shared memory: one producer posts a counter, one consumer in another process
waits for it with a bounded spin, then sleeps on a futex.

The doorbell is two 32-bit words in a shared mapping: `seq` (how many messages the producer
has published, modulo 2**32) and `sleeping` (1 while the consumer may be asleep in the
kernel). The consumer spins on `seq` for at most `spin_s` (a peer that answers within that
is seen without a futex), yielding the CPU between looks (sched_yield, which also lets the
process's other threads have the GIL), then sets `sleeping` and waits on `seq` with
FUTEX_WAIT, in slices of at most `SLEEP_SLICE_S`, until the value changes, its deadline
passes or its `should_stop` says so: a stalled peer costs one short spin, then nothing.

The producer writes its payload, stores `seq`, and calls FUTEX_WAKE only when `sleeping` is
set (a futex wake of a shared mapping costs microseconds here). Between that store and that
load x86 may reorder (store buffer); the producer puts a full fence between them by an
uncontended lock round trip (a locked instruction). Should a wake ever be missed, the
consumer sleeps one slice at most, never for ever. The words are accessed through a
memoryview cast to 'I': each access is one aligned 32-bit load or store (struct's
little-endian codes would write byte by byte, which a spinning reader could see half done).

`seen_ns` is when the last wait() saw the change (CLOCK_MONOTONIC; 0 when the value was already
there), so a caller can tell the wake-up from the time its own thread needed after it.

x86-64 Linux only: its total store order is what makes the payload visible before `seq`
without further barriers (SUPPORTED says whether this process can use it).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable

SUPPORTED = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
SLEEP_SLICE_S = 1.0  # the longest one futex wait; a missed wake or stop costs at most this
DEFAULT_SPIN_S = 200e-6  # measured: 200 µs with yields beat 50 µs by 1.5x on a loaded 2-core host
WORDS_BYTES = 8  # seq, sleeping

_libc = ctypes.CDLL(None, use_errno=True) if SUPPORTED else None
if _libc is not None:
    _libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Doorbell:
    """The doorbell whose two words start at `offset` (4-byte aligned) of `mapping`.

    Holds a ctypes view of the mapping (for the futex address): call release() before the
    mapping is closed.
    """

    def __init__(self, mapping: mmap.mmap, offset: int, spin_s: float = DEFAULT_SPIN_S):
        if not SUPPORTED:
            raise OSError("shared-memory doorbells need Linux on x86-64")
        if offset % 4:
            raise ValueError(f"doorbell offset {offset} is not 4-byte aligned")
        self._anchor = ctypes.c_uint32.from_buffer(mapping, offset)
        self._address = ctypes.addressof(self._anchor)
        self._words = memoryview(mapping)[offset:offset + WORDS_BYTES].cast("I")
        self.words = self._words  # [seq, sleeping]: a reader may look at seq itself before calling wait()
        self._fence_lock = threading.Lock()
        self.spin_s = spin_s
        self.num_sleeps = 0  # how often wait() went to the kernel (a measure of the spin's reach)
        self.seen_ns = 0  # when the last wait() saw the change (0: it was there already)

    @property
    def seq(self) -> int:
        return self._words[0]

    def post(self, seq: int) -> None:
        """Producer: publish seq (after the payload is written) and wake a sleeping consumer."""
        self._words[0] = seq & 0xFFFFFFFF
        with self._fence_lock:  # StoreLoad fence: seq must be visible before `sleeping` is read
            pass
        if self._words[1]:
            self._futex(_FUTEX_WAKE, 1 << 30, None)

    def interrupt(self) -> None:
        """Same process as the consumer: make its wait return now (its session is ending).
        Clobbers seq, which the consumer then checks its stop condition against."""
        self._words[0] = (self._words[0] + 0x80000000) & 0xFFFFFFFF
        self._futex(_FUTEX_WAKE, 1 << 30, None)

    def wait(self, seq: int, deadline_s: float | None, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Consumer: wait until the doorbell reads `seq` (True), or stop / deadline (False).

        deadline_s is on time.monotonic(); None waits until should_stop() or a change. A value
        other than the one expected also returns True: the caller compares and reports it. Spins
        for self.spin_s first, then sleeps on the futex."""
        words = self._words
        target = seq & 0xFFFFFFFF
        self.seen_ns = 0
        if words[0] == target:
            return True
        previous = (target - 1) & 0xFFFFFFFF
        spin_until = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_until:
            if words[0] != previous:
                self.seen_ns = time.monotonic_ns()
                return True
            os.sched_yield()  # a spinning waiter gives way to whoever else is runnable (the peer, say)
        while True:
            if should_stop():
                return False
            remaining_s = SLEEP_SLICE_S if deadline_s is None else min(SLEEP_SLICE_S, deadline_s - time.monotonic())
            if remaining_s <= 0:
                return words[0] != previous
            if self._sleep(previous, remaining_s):
                return True

    def _sleep(self, previous: int, timeout_s: float) -> bool:
        """One futex sleep while seq reads `previous`, for at most timeout_s; True once it changed."""
        words = self._words
        words[1] = 1
        try:
            if words[0] == previous:
                self.num_sleeps += 1
                self._futex(_FUTEX_WAIT, previous, timeout_s)
        finally:
            words[1] = 0
        if words[0] != previous:
            self.seen_ns = time.monotonic_ns()
            return True
        return False

    def _futex(self, op: int, value: int, timeout_s: float | None) -> None:
        timeout = None
        if timeout_s is not None:
            whole_s = int(timeout_s)
            timeout = ctypes.byref(_Timespec(whole_s, int((timeout_s - whole_s) * 1e9)))
        result = _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._address), op, ctypes.c_uint32(value),
                               timeout, None, 0)
        if result < 0:
            code = ctypes.get_errno()
            if code not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
                raise OSError(code, f"futex: {os.strerror(code)}")

    def release(self) -> None:
        """Drop the views of the mapping (so it can be closed)."""
        self._words.release()
        self._anchor = None
