"""The shared KV pool's pages are faulted in ahead by a background thread (dualpace.engine.transfer.shm_populate)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os

import pytest

from dualpace.engine.transfer import shm_populate

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux memfd")

NUM_PAGES = 64


def resident_pages(buffer: mmap.mmap) -> int:
    """Pages of the mapping present in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vec = (ctypes.c_ubyte * NUM_PAGES)()
    view = ctypes.c_char.from_buffer(buffer)
    try:
        assert libc.mincore(ctypes.addressof(view), len(buffer), vec) == 0, ctypes.get_errno()
    finally:
        del view
    return sum(v & 1 for v in vec)


def fresh_mapping() -> mmap.mmap:
    fd = os.memfd_create("populate-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, NUM_PAGES * mmap.PAGESIZE)
        return mmap.mmap(fd, NUM_PAGES * mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def test_every_page_is_present_once_the_thread_is_done():
    buffer = fresh_mapping()
    assert resident_pages(buffer) == 0
    thread = shm_populate.populate(buffer, "test pool")
    assert thread is not None
    thread.join(30)
    if resident_pages(buffer) == 0:
        pytest.skip("MADV_POPULATE_WRITE not supported by this kernel")
    assert resident_pages(buffer) == NUM_PAGES
    assert buffer[:16] == b"\0" * 16  # contents unchanged
    buffer.close()  # the thread holds no export of the buffer


def test_a_mapping_dropped_meanwhile_is_let_go(monkeypatch):
    monkeypatch.setattr(shm_populate, "CHUNK_BYTES", mmap.PAGESIZE)
    buffer = fresh_mapping()
    thread = shm_populate.populate(buffer, "test pool")
    del buffer
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
