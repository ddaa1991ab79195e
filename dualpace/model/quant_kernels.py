"""ctypes access to quant_kernels.cpp (linear and row dequantization on GGUF block weights).

These serve the per-stage path (QuantizedWeight.linear / .embedding). The fused decode path of
cpu_kernels.cpp includes quant_gemv.h itself. Built at `make venv` time where a compiler exists
(`python -m dualpace.model.quant_kernels`), else on first use, with g++ with the ISA flags of
cpu_kernels_build's variant for this CPU (avx512_bf16, avx512, avx2; -march=native and the
header's plain C++ path for generic), the one DUALPACE_CPU_KERNELS names when it names one,
cached under `$XDG_CACHE_HOME/dualpace/kernels/` keyed by the sources, the flags, the compiler
and the CPU flags; the .so shares torch's OpenMP runtime (one pool, torch.set_num_threads).
`DUALPACE_CPU_KERNELS=0` turns these off too, leaving the torch fallback of QuantizedWeight.

Activation arithmetic (quant_gemv.h): `int16` (the exact mode) until `quant_activations.set_activations()` chooses
`int8` (from a few rows, on CPUs with AVX-512 VNNI) or `fp32` (the tests' reference); the engines
set it from --quant-activations (dualpace.serve.config: flag, DUALPACE_QUANT_ACTIVATIONS or TOML).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from dualpace.model import cpu_kernels_build as kbuild
from dualpace.model import quant_activations
from dualpace.model.native_build import build_atomically, compiler_version, kernel_cache_dir

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "quant_kernels.cpp", _HERE / "quant_gemv.h", _HERE / "quant_gemv_i16.h",
           _HERE / "quant_gemv_avx512.h", _HERE / "quant_gemv_vnni.h", _HERE / "quant_gemv_vnni_rows.h",
           _HERE / "quant_gemv_q8k.h", _HERE / "quant_gemv_block_pairs.h",
           _HERE / "kernel_weights.h"]
_BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


class WeightDescC(ctypes.Structure):
    """Mirrors WeightDesc in kernel_weights.h."""

    _fields_ = [("format", ctypes.c_int32), ("reserved", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("row_bytes", ctypes.c_int64)]


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "dp_quant_has_avx2": ([], ctypes.c_int),
    "dp_quant_vector_bits": ([], ctypes.c_int),
    "dp_quant_fp32_min_rows": ([], ctypes.c_int64),
    "dp_quant_int8_min_rows": ([], ctypes.c_int64),
    "dp_quant_int8_k_max_rows": ([], ctypes.c_int64),
    "dp_quant_int8_pairs_max_rows": ([], ctypes.c_int64),
    "dp_quant_int8_outlier_ratio": ([], ctypes.c_float),
    "dp_quant_format_supported": ([ctypes.c_int32], ctypes.c_int),
    "dp_quant_set_activations": ([ctypes.c_int32], ctypes.c_int32),
    "dp_quant_linear": ([ctypes.POINTER(WeightDescC), _ptr, _i64, _i64, _ptr, _i64], ctypes.c_int),
    "dp_quant_dequantize_rows": ([ctypes.POINTER(WeightDescC), _ptr, _i64, _ptr], ctypes.c_int),
    "dp_quant_dequantize_range": ([ctypes.POINTER(WeightDescC), _i64, _i64, _ptr], ctypes.c_int),
}
_state: dict[str, object] = {}


def chosen_variant() -> str:
    """The instruction-set variant (cpu_kernels_build's names) these kernels are built for: the one
    DUALPACE_CPU_KERNELS names when this CPU runs it, else the best this CPU runs."""
    supported = kbuild.supported_variants()
    requested = os.environ.get("DUALPACE_CPU_KERNELS", "").strip().lower()
    return requested if requested in supported else supported[0]


def compile_flags(variant: str | None = None) -> list[str]:
    """A variant's ISA flags (generic: -march=native, whose plain C++ path quant_gemv.h takes without AVX2)."""
    name = variant or chosen_variant()
    isa = ["-march=native"] if name == kbuild.GENERIC.name else list(kbuild.VARIANTS[name].flags)
    return [*_BASE_FLAGS, *isa, f"-I{_HERE}"]


def library_path(flags: list[str]) -> Path:
    compiler = compiler_version("g++")
    text = "\n".join([*(p.read_text() for p in SOURCES), " ".join(flags), compiler,
                      " ".join(sorted(kbuild.cpu_flags()))])
    return kernel_cache_dir() / f"quant_kernels-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"


def _build(path: Path, flags: list[str]) -> None:
    build_atomically(path, lambda out: ["g++", *flags, "-o", str(out), str(SOURCES[0])])


def ensure_built(variant: str) -> Path:
    """The library of `variant`, built first when not cached. Raises CalledProcessError/OSError."""
    flags = compile_flags(variant)
    path = library_path(flags)
    if not path.exists():
        _build(path, flags)
        log.info("built quantized-weight kernels (%s) at %s", variant, path)
    return path


def _load(variant: str) -> ctypes.CDLL | None:
    flags = compile_flags(variant)
    try:
        lib = ctypes.CDLL(str(ensure_built(variant)))
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
    quant_activations.register(lib)
    return lib


def load_variant(variant: str) -> ctypes.CDLL | None:
    """The library built for `variant` (one of kbuild.supported_variants()), loaded once per process;
    None when it cannot be built here. Benchmarks load two to compare them; get() is the one in use."""
    libs = _state.setdefault("variants", {})
    if variant not in libs:
        import torch  # noqa: F401  (torch's libgomp first, so the .so shares its OpenMP runtime)

        libs[variant] = _load(variant)
    return libs[variant]


def select_variant(variant: str) -> ctypes.CDLL | None:
    """Make get() return the library of `variant` from now on (tests run every variant the CPU runs)."""
    _state["lib"] = load_variant(variant)
    return _state["lib"]  # type: ignore[return-value]


def get() -> ctypes.CDLL | None:
    """The loaded library, or None when turned off or not buildable here."""
    if os.environ.get("DUALPACE_CPU_KERNELS", "1") in ("0", "false", "off"):
        return None
    if "lib" not in _state:
        _state["lib"] = load_variant(chosen_variant())
    return _state["lib"]  # type: ignore[return-value]


def main() -> int:
    """Build the library of this CPU's variant now (`make venv`); 1, with the reason, where it cannot be."""
    variant = chosen_variant()
    try:
        path = ensure_built(variant)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()[:500]
        print(f"quantized-weight kernels ({variant}) not built; GGUF weights will be dequantized in torch: {detail}",
              file=sys.stderr)
        return 1
    print(f"quantized-weight kernels ({variant}): {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
