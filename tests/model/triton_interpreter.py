"""Imported first by the tests of the Triton kernels: they run under Triton's interpreter on CPU tensors.

Triton reads the flag when it is imported (its own library functions are made then), so it is set
before the first import; the engines' auto backends never use Triton on CPU tensors."""

from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
