"""Building the native libraries (no compiler runs here). The cache key: a -march=native build is
keyed by the machine too, so a cache shared by machines of different CPUs never hands one the code
of another. `make venv` builds each library, tolerating a machine without a compiler."""

from __future__ import annotations

import importlib
import itertools
from pathlib import Path

import pytest

from dualpace.model import cpu_kernels_build as kbuild
from dualpace.model import quant_kernels

ROOT = Path(__file__).resolve().parents[2]

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


def venv_recipe() -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$(STAMP):"))
    return [line.strip() for line in itertools.takewhile(lambda line: line.startswith("\t"), lines[start + 1:])]


@pytest.mark.parametrize("module", ["dualpace.model.cpu_kernels_build", "dualpace.model.quant_kernels",
                                    "dualpace.engine.transfer.kv_copy_native"])
def test_make_venv_builds_each_native_library(module):
    """Each built at `make venv` (the leading `-`: a failed build, say without a compiler, goes on)."""
    assert f"-$(BIN)/python -m {module}" in venv_recipe()
    assert callable(importlib.import_module(module).main)


def test_quant_kernels_main_builds_once_then_uses_the_cache(monkeypatch, tmp_path, capsys):
    built = []
    monkeypatch.setattr(quant_kernels, "kernel_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(quant_kernels, "_build", lambda path, flags: (built.append(flags), path.touch()))
    assert quant_kernels.main() == 0 and quant_kernels.main() == 0
    assert len(built) == 1 and "-shared" in built[0]
    assert str(tmp_path) in capsys.readouterr().out


def test_quant_kernels_main_without_a_compiler(monkeypatch, tmp_path, capsys):
    def no_compiler(path, flags):
        raise FileNotFoundError("g++")

    monkeypatch.setattr(quant_kernels, "kernel_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(quant_kernels, "_build", no_compiler)
    assert quant_kernels.main() == 1
    assert "dequantized in torch" in capsys.readouterr().err
