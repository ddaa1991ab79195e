"""ctypes access to kv_copy_native.c: a layer's KV copied and CRC32C'd in one pass.

The CRC runs as carry-less multiply folding where the CPU has VPCLMULQDQ (on 512-bit registers
with AVX-512, else on 256-bit ones with AVX2; chosen at load), else as three interleaved crc32
instruction chains. Built with gcc (-O3 -msse4.2;
the folding functions carry their own target attribute) at `make venv` time where a compiler exists, else on first use,
and cached under `$XDG_CACHE_HOME/dualpace/kernels/` keyed by the source, the flags and the
compiler's version. Where it cannot be used (no compiler, not x86, no SSE4.2, or
`DUALPACE_CPU_KERNELS=0`), `get()` is None and the caller keeps numpy's copy plus the `crc32c`
package; that is logged once. Its checksums are the package's exactly (the values on the wire).
ctypes releases the GIL for each call, so several threads copy at once.

    python -m dualpace.engine.transfer.kv_copy_native     # build it now (make venv)
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

from dualpace.model.native_build import build_atomically, compiler_version, kernel_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kv_copy_native.c")
FLAGS = ("-O3", "-msse4.2", "-shared", "-fPIC", "-std=c11")

_ptr, _i64, _u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
_SIGNATURES = {
    "dp_kv_copy_supported": ([], ctypes.c_int),
    "dp_copy_crc32c": ([_ptr, _ptr, _i64, _u32], _u32),
    "dp_kv_layer_copy_crc32c": ([_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64], _u32),
    "dp_kv_layers_copy_crc32c": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64], None),
    "dp_kv_crc_path": ([], ctypes.c_int),
    "dp_kv_set_crc_path": ([ctypes.c_int], ctypes.c_int),
}
CRC_PATHS = ("crc32 lanes", "vpclmulqdq folding", "vpclmulqdq folding (ymm)")  # by dp_kv_crc_path()
_state: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def library_path() -> Path:
    """Where the library built from this source, with these flags and this compiler, lives."""
    digest = hashlib.sha256(SOURCE.read_bytes() + b"\0" + " ".join(FLAGS).encode() + b"\0"
                            + compiler_version("gcc").encode())
    return kernel_cache_dir() / f"kv_copy_native-{digest.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    build_atomically(path, lambda out: ["gcc", *FLAGS, "-o", str(out), str(SOURCE)])


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The library, or None and why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    try:
        path = library_path()
        if not path.exists():
            _build(path)
            log.info("built the fused KV copy + CRC32C at %s", path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, (getattr(exc, "stderr", "") or str(exc)).strip()[:500]
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    if not lib.dp_kv_copy_supported():
        return None, "the CPU has no SSE4.2 CRC instruction"
    return lib, ""


def get() -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) when it cannot be used here."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                if os.environ.get("DUALPACE_CPU_KERNELS", "1") in ("0", "false", "off"):
                    lib, why = None, "DUALPACE_CPU_KERNELS=0"
                else:
                    lib, why = _load()
                if lib is None:
                    log.warning("fused KV copy + CRC32C unavailable (%s): numpy copy + crc32c package", why)
                _state["lib"] = lib
    return _state["lib"]


def crc_path() -> str:
    """The CRC loop in use: "vpclmulqdq folding" (carry-less multiply folding on 512-bit registers,
    where the CPU has VPCLMULQDQ and AVX-512), "vpclmulqdq folding (ymm)" (on 256-bit ones: AVX2 +
    VPCLMULQDQ), "crc32 lanes" (the SSE4.2 instruction) or "numpy + crc32c" (no library)."""
    lib = get()
    return CRC_PATHS[lib.dp_kv_crc_path()] if lib is not None else "numpy + crc32c"


def set_crc_path(path: int) -> str:
    """Force a CRC loop (tests, benches; only while no copy runs): 1 the widest folding the CPU has,
    2 the ymm folding, 0 the crc32 lanes, each falling back to the next narrower one the CPU has.
    Returns the loop now in force."""
    lib = get()
    if lib is not None:
        lib.dp_kv_set_crc_path(path)
    return crc_path()


def main() -> int:
    lib, why = _load()
    if lib is None:
        print(f"fused KV copy + CRC32C not built; the shm transfer will use numpy + crc32c: {why}", file=sys.stderr)
        return 1
    print(f"fused KV copy + CRC32C ({CRC_PATHS[lib.dp_kv_crc_path()]}): {library_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
