"""Building the native libraries (no compiler runs here). The cache key: a -march=native build is
keyed by the machine too, so a cache shared by machines of different CPUs never hands one the code
of another."""

from __future__ import annotations

import pytest

from dualpace.model import cpu_kernels_build as kbuild

ZEN3 = frozenset({"avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"}


def key(monkeypatch, variant: str, flags: frozenset[str], compiler: str = "g++ (GCC) 13.2.0") -> str:
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kbuild, "compiler_version", lambda _name: compiler)
    return kbuild.library_path(kbuild.VARIANTS[variant]).name


def test_native_build_keyed_by_the_cpu_flags(monkeypatch):
    assert key(monkeypatch, "generic", ZEN3) != key(monkeypatch, "generic", SAPPHIRE_RAPIDS)
    assert key(monkeypatch, "generic", ZEN3) == key(monkeypatch, "generic", frozenset(sorted(ZEN3)))


@pytest.mark.parametrize("variant", ["generic", "avx2"])
def test_every_build_keyed_by_the_compiler(monkeypatch, variant):
    assert key(monkeypatch, variant, ZEN3) != key(monkeypatch, variant, ZEN3, compiler="g++ (GCC) 14.1.0")


def test_explicit_isa_build_shared_across_cpus(monkeypatch):
    """Its flags name every instruction it may use: one build serves every CPU that runs them."""
    assert key(monkeypatch, "avx2", ZEN3) == key(monkeypatch, "avx2", SAPPHIRE_RAPIDS)
