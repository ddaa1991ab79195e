"""Kernel backend selection for the CPU engine.

Only the torch backend is implemented. Intel Extension for PyTorch exists only up
to 2.8, which needs torch 2.8 and refuses the torch this project installs, so its
kernels cannot be built or tested here; `--backend ipex` says so clearly instead of
silently running torch kernels, and `auto` resolves to torch.
"""

from __future__ import annotations

from dualpace.errors import InvalidArgument

BACKENDS = ("auto", "torch", "ipex")


def ipex_import_error() -> str | None:
    """None when intel_extension_for_pytorch imports with this torch, else why not."""
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or its own torch-version check raising
        return f"{type(exc).__name__}: {exc}"
    return None


def select_backend(requested: str) -> str:
    if requested not in BACKENDS:
        raise InvalidArgument("--backend", f"unknown backend {requested!r}; use {', '.join(BACKENDS)}")
    if requested == "ipex":
        error = ipex_import_error()
        reason = error if error is not None else "its kernel path is not implemented yet"
        raise InvalidArgument("--backend", f"ipex is not available ({reason}); use torch")
    return "torch"
