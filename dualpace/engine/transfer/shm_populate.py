"""Fault a shared KV pool's pages in ahead of the transfers, in a background thread.

A transfer into blocks never touched before pays a page fault per 4 KiB page on the side that
writes (and the owner's pages are allocated then): measured, a 1024-token copy into
a fresh pool took 165 ms the first time and 18 ms the second. So both mappings are populated
once, off the event loop: the owner's right after the pool is made (a private pool is zeroed,
i.e. committed, at start anyway; a shared one was committed lazily), the sender's right after it
maps a target's pool (page-table entries only: the pages are the owner's). MADV_POPULATE_WRITE
(Linux 5.14) faults the range in as a write would, without changing its contents, and ctypes
releases the GIL for each call, so the engine keeps running meanwhile. The thread holds the
mapping only for one chunk at a time (a weak reference between chunks): a pool dropped meanwhile
goes back to the kernel as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
import weakref

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it before 3.12
CHUNK_BYTES = 64 * 2**20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _base_address(buffer: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # the export ends here: the mapping may be closed or freed later as before


def populate(buffer: mmap.mmap, what: str) -> threading.Thread | None:
    """Start faulting `buffer`'s pages in (a daemon thread); its cost is logged when it is done."""
    try:
        base = _base_address(buffer)
    except (TypeError, ValueError, BufferError):
        return None
    total = len(buffer)
    ref = weakref.ref(buffer)

    def run() -> None:
        start = time.perf_counter()
        done = 0
        while done < total:
            held = ref()
            if held is None:
                log.debug("%s dropped while its pages were faulted in", what)
                return
            size = min(CHUNK_BYTES, total - done)
            if _libc.madvise(base + done, size, MADV_POPULATE_WRITE) != 0:
                log.info("%s: pages not faulted in ahead (madvise: errno %d)", what, ctypes.get_errno())
                return
            del held
            done += size
        log.info("%s: %d MB of pages faulted in ahead in %.0f ms", what, total // 2**20,
                 (time.perf_counter() - start) * 1e3)

    thread = threading.Thread(target=run, name=f"populate {what}", daemon=True)
    thread.start()
    return thread
