"""ctypes access to quant_kernels.cpp (linear and row dequantization on GGUF block weights).

These serve the per-stage path (QuantizedWeight.linear / .embedding). The fused decode path of
cpu_kernels.cpp includes quant_gemv.h itself. Built on first use with g++ (AVX2 + FMA + F16C
where the CPU has them, else -march=native and the header's plain C++ path), cached under
`$XDG_CACHE_HOME/dualpace/kernels/` keyed by the sources, the flags, the compiler and the CPU
flags; the .so shares torch's OpenMP runtime (one pool, torch.set_num_threads).
`DUALPACE_CPU_KERNELS=0` turns these off too, leaving the torch fallback of QuantizedWeight.

Activation arithmetic (quant_gemv.h): `int16` by default, `fp32`, `int8` or `int16-split` with
DUALPACE_QUANT_ACTIVATIONS, or `set_activations()` in-process (tests and benchmarks).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from pathlib import Path

from dualpace.model.native_build import build_atomically, compiler_version, kernel_cache_dir

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "quant_kernels.cpp", _HERE / "quant_gemv.h", _HERE / "quant_gemv_i16.h",
           _HERE / "quant_gemv_q8_split.h", _HERE / "kernel_weights.h"]
_BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]


class WeightDescC(ctypes.Structure):
    """Mirrors WeightDesc in kernel_weights.h."""

    _fields_ = [("format", ctypes.c_int32), ("reserved", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("row_bytes", ctypes.c_int64)]


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "dp_quant_has_avx2": ([], ctypes.c_int),
    "dp_quant_format_supported": ([ctypes.c_int32], ctypes.c_int),
    "dp_quant_set_activations": ([ctypes.c_int32], ctypes.c_int32),
    "dp_quant_linear": ([ctypes.POINTER(WeightDescC), _ptr, _i64, _i64, _ptr, _i64], ctypes.c_int),
    "dp_quant_dequantize_rows": ([ctypes.POINTER(WeightDescC), _ptr, _i64, _ptr], ctypes.c_int),
    "dp_quant_dequantize_range": ([ctypes.POINTER(WeightDescC), _i64, _i64, _ptr], ctypes.c_int),
}
_state: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    has_avx2 = {"avx2", "fma", "f16c"} <= _cpu_flags()
    return [*_BASE_FLAGS, *(_AVX2_FLAGS if has_avx2 else ["-march=native"]), f"-I{_HERE}"]


def library_path(flags: list[str]) -> Path:
    compiler = compiler_version("g++")
    text = "\n".join([*(p.read_text() for p in SOURCES), " ".join(flags), compiler, " ".join(sorted(_cpu_flags()))])
    return kernel_cache_dir() / f"quant_kernels-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"


def _build(path: Path, flags: list[str]) -> None:
    build_atomically(path, lambda out: ["g++", *flags, "-o", str(out), str(SOURCES[0])])


def _load() -> ctypes.CDLL | None:
    flags = compile_flags()
    try:
        path = library_path(flags)
        if not path.exists():
            _build(path, flags)
            log.info("built quantized-weight kernels (%s) at %s", "avx2" if "-mavx2" in flags else "generic", path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("quantized-weight kernels unavailable, dequantizing in torch: %s", detail.strip()[:500])
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    if "-mavx2" in flags and not lib.dp_quant_has_avx2():
        return None
    return lib


def get() -> ctypes.CDLL | None:
    """The loaded library, or None when turned off or not buildable here."""
    if os.environ.get("DUALPACE_CPU_KERNELS", "1") in ("0", "false", "off"):
        return None
    if "lib" not in _state:
        import torch  # noqa: F401  (torch's libgomp first, so the .so shares its OpenMP runtime)

        _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


ACTIVATION_MODES = {"fp32": 0, "int16": 1, "int8": 2, "int16-split": 3}  # quant_gemv.h's ActivationMode


def set_activations(mode: str) -> None:
    """Use `mode` (fp32, int16, int8, int16-split) for the activations of block-quantized weights from now on,
    in these kernels and in every loaded cpu_kernels variant. Not while a linear call runs."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activation mode {mode!r}: expected one of {', '.join(ACTIVATION_MODES)}")
    from dualpace.model import cpu_kernels

    libs = [get(), *(k.lib for k in cpu_kernels.loaded_kernels())]
    for lib in libs:
        if lib is not None:
            lib.dp_quant_set_activations(ACTIVATION_MODES[mode])
