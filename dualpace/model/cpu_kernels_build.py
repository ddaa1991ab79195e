"""Which CPU-kernel variant this CPU runs, and building it (once per source + compiler + variant).

The variants (KERNELS.md) are one source tree compiled with different instruction-set flags.
Detection reads the CPU's flags from /proc/cpuinfo; the library checks them again itself
(`dp_variant_supported`) once loaded. Built libraries are cached under
`$XDG_CACHE_HOME/dualpace/kernels/` (default `~/.cache/...`); the cache key covers every source
file, the compile flags and the compiler's version, and for `-march=native` (generic) also the
machine (its architecture and CPU flags, `native_machine_key`), since that code may use every
instruction of the CPU that built it; so a cache shared by several machines stays correct.

    python -m dualpace.model.cpu_kernels_build          # build the variant for this CPU (make venv)
    python -m dualpace.model.cpu_kernels_build --all    # every variant this CPU can run
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dualpace.model.native_build import build_atomically, compiler_version, kernel_cache_dir

SOURCE_DIR = Path(__file__).parent
MAIN_SOURCE = SOURCE_DIR / "cpu_kernels.cpp"
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_AVX512_COMMON = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c")


@dataclass(frozen=True)
class Variant:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags
    flags: tuple[str, ...]


# best first
X86_VARIANTS = (
    Variant("avx512_bf16", _AVX512_COMMON + ("avx512_bf16", "avx512_vnni"),  # every avx512_bf16 CPU has VNNI
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma",
             "-mf16c")),
    Variant("avx512", _AVX512_COMMON, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
                                       "-mf16c")),
    Variant("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
)
# plain C++ that the compiler vectorises for the machine it runs on
GENERIC = Variant("generic", (), ("-march=native", "-DDP_GENERIC"))
VARIANTS = {v.name: v for v in (*X86_VARIANTS, GENERIC)}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, aarch64 `Features` of /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def supported_variants(flags: frozenset[str] | None = None) -> list[str]:
    """Names of the variants this CPU can run, best first (generic last, always)."""
    flags = cpu_flags() if flags is None else flags
    names = [v.name for v in X86_VARIANTS if is_x86() and set(v.needs) <= flags]
    return [*names, GENERIC.name]


def default_variant(flags: frozenset[str] | None = None) -> str:
    return supported_variants(flags)[0]


def source_files() -> list[Path]:
    """The translation unit and every header beside it (quant_gemv.h included when present)."""
    return [MAIN_SOURCE, *sorted(SOURCE_DIR.glob("*.h"))]


def compile_command(variant: Variant, out: Path) -> list[str]:
    return ["g++", *BASE_FLAGS, *variant.flags, "-I", str(SOURCE_DIR), "-o", str(out), str(MAIN_SOURCE)]


def native_machine_key(flags: list[str] | tuple[str, ...]) -> str:
    """What a build with `flags` depends on of the machine that compiles it: with -march=native, the
    architecture and every CPU flag (the compiler may use any instruction this CPU has); else nothing
    (explicit ISA flags name all the code may use)."""
    if "-march=native" not in flags:
        return ""
    return platform.machine() + ":" + " ".join(sorted(cpu_flags()))


def library_path(variant: Variant) -> Path:
    """Where the built library of this variant, for these sources and this compiler (and, for
    -march=native, this machine), lives."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join((*BASE_FLAGS, *variant.flags)).encode() + b"\0" + compiler_version("g++").encode())
    machine = native_machine_key(variant.flags)
    if machine:  # (explicit-ISA variants keep the key they had before the machine was part of it)
        digest.update(b"\0" + machine.encode())
    return kernel_cache_dir() / f"cpu_kernels-{variant.name}-{digest.hexdigest()[:16]}.so"


def build(variant: Variant, path: Path) -> float:
    """Compile `variant` to `path`; returns the seconds it took. Raises CalledProcessError/OSError."""
    start = time.perf_counter()
    build_atomically(path, lambda out: compile_command(variant, out))
    return time.perf_counter() - start


def ensure_built(variant: Variant) -> tuple[Path, float | None]:
    """The library path, building it first when it is not cached (seconds, or None if cached)."""
    path = library_path(variant)
    if path.exists():
        return path, None
    return path, build(variant, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every variant this CPU supports, not just the best")
    args = p.parse_args(argv)
    names = supported_variants() if args.all else [default_variant()]
    status = 0
    for name in names:
        try:
            path, seconds = ensure_built(VARIANTS[name])
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip()[:500]
            print(f"CPU kernels ({name}) not built; the engine will use torch ops: {detail}", file=sys.stderr)
            status = 1
            continue
        print(f"CPU kernels ({name}): {'built in %.1f s' % seconds if seconds else 'cached'} at {path}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
