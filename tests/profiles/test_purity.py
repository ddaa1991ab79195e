"""profiles.schema and profiles.cost_model stay pure (ARCHITECTURE §5): the router, the CPU
engine's mode choice and the simulator use them, so they must not pull in torch, grpc,
asyncio or a clock. The profiler (profiles.profiler) is where those live."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_MODULES = ("profiles.schema", "profiles.cost_model", "cpu_service.mode_choice", "router.views")
FORBIDDEN_PACKAGES = ("torch", "grpc", "asyncio", "time", "datetime", "random", "numpy")


def test_pure_modules_import_nothing_heavy():
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        f"import {', '.join(PURE_MODULES)}\n"
        "added = set(sys.modules) - before\n"
        f"bad = sorted(m for m in added if m.split('.')[0] in {FORBIDDEN_PACKAGES!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                            check=True)
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_sources_import_no_clock(module):
    path = ROOT / (module.replace(".", "/") + ".py")
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint(FORBIDDEN_PACKAGES), imported & set(FORBIDDEN_PACKAGES)
