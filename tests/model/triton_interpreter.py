"""Imported first by the tests of the Triton kernels: they run under Triton's interpreter on CPU tensors.

Triton reads the flag when it is imported (its own library functions are made then), so it is set
before the first import; the engines' auto backends never use Triton on CPU tensors. use_kernels
sets the process's kernel choice for one test (what an engine daemon's --attention-backend and
--fused-kernels set)."""

from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")


def use_kernels(monkeypatch, **choices: str) -> None:
    """This test's dualpace.model.attention_backend choice (attention_backend=, fused_kernels=)."""
    import dataclasses

    from dualpace.model import attention_backend

    monkeypatch.setattr(attention_backend, "_chosen", dataclasses.replace(attention_backend.chosen(), **choices))
