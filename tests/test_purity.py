"""The scheduling and decision code stays pure (docs/architecture.md, "Layout and floors"): no
torch, grpc, asyncio, clock, randomness or numpy, so it can be unit-tested and simulated. One list for the whole
project: the engine's scheduler, cpu_service's mode choice, the GPU step's cooperative layout, the
serving policies' traits, the router's views, admission and migration planner, and the profiles' schema and cost model (the router and the simulator use them)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE_MODULES = (
    "dualpace.engine.scheduler",
    "dualpace.policy.mode_choice",
    "dualpace.policy.cooperative_plan",
    "dualpace.policy.policies",
    "dualpace.policy.views",
    "dualpace.policy.admission",
    "dualpace.policy.migration_planner",
    "dualpace.profile.schema",
    "dualpace.profile.cost_model",
)
FORBIDDEN_PACKAGES = ("torch", "grpc", "asyncio", "time", "datetime", "random", "numpy")


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_sources_import_no_io_or_clock(module):
    path = ROOT / (module.replace(".", "/") + ".py")
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint(FORBIDDEN_PACKAGES), imported & set(FORBIDDEN_PACKAGES)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_alone_loads_nothing_impure(module):
    """Importing it in a fresh interpreter adds none of the forbidden modules. `time` is built in
    and loaded at interpreter start, so only what the import adds counts; the source check above
    covers `time` itself."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        f"import {module}\n"
        "added = set(sys.modules) - before\n"
        f"bad = sorted(m for m in added if m.split('.')[0] in {FORBIDDEN_PACKAGES!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
