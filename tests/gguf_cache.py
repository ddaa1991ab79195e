"""gguf.GGUFReader once per file in the test process: the SmolLM2 files' vocabulary is parsed field
by field (~2.5 s a parse), and the in-process tests load the default model about a dozen times
(fixtures, tokenizers, exports, transformers' references) and the files made from it several."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def once_per_file(reader_class: Callable) -> Callable:
    """A drop-in for gguf.GGUFReader that returns the reader already made for the same unchanged
    file (same path, inode, size and modification time): a reader is read-only (its tensors are
    views of a read-only memmap, and nothing in dualpace assigns to it), so its next user reads the
    same fields and tensors as from a fresh parse. Other modes, unreadable paths and failed parses
    go to reader_class as before (a failure is not kept)."""
    made: dict[tuple, object] = {}
    lock = threading.Lock()

    def reader(path, mode="r"):
        try:
            stat = os.stat(path)
        except (OSError, TypeError, ValueError):
            return reader_class(path, mode)
        if mode != "r":
            return reader_class(path, mode)
        key = (os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with lock:
            if key not in made:
                made[key] = reader_class(path, mode)
            return made[key]

    return reader
