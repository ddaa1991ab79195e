"""Settings come through the config module (dualpace/serve/config.py: flag > DUALPACE_<FLAG> >
TOML). Outside it the tree reads only the documented DUALPACE_* variables below (docs/operations.md,
"Configuration file and environment"): the CPU kernels' choice and the CLI's tracebacks.

Read from the sources (Python with ast, C and C++ by their getenv calls); setting a variable for a
child process is not a read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dualpace", "gpu_service", "cpu_service", "router", "dynamo_worker", "toolkit", "profiles", "bench",
            "dualpace_cli")
CONFIG_MODULE = ROOT / "dualpace" / "serve" / "config.py"
READ_ELSEWHERE = {"DUALPACE_CPU_KERNELS", "DUALPACE_CPU_AMX", "DUALPACE_TRACEBACK"}
C_GETENV = re.compile(r"getenv\s*\(\s*\"(DUALPACE_[A-Z0-9_]*)\"")


def _is_environ(node: ast.AST) -> bool:
    """os.environ or a bare environ."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                            and node.id == "environ")


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("DUALPACE_"):
        return node.value
    return None


def python_reads(source: str) -> set[str]:
    """The DUALPACE_* variables `source` reads: os.environ.get / os.getenv / environ[...] (loads
    only) / `in os.environ`."""
    reads = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            getter = (isinstance(func, ast.Attribute) and ((func.attr == "get" and _is_environ(func.value))
                                                           or func.attr == "getenv"))
            if getter and _name(node.args[0]):
                reads.add(_name(node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            if _name(node.slice):
                reads.add(_name(node.slice))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators) and _name(node.left):
            reads.add(_name(node.left))
    return reads


def reads_outside_the_config_module() -> dict[str, set[str]]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path == CONFIG_MODULE or not path.is_file():
                continue
            if path.suffix == ".py":
                reads = python_reads(path.read_text())
            elif path.suffix in (".c", ".cpp", ".h"):
                reads = set(C_GETENV.findall(path.read_text()))
            else:
                continue
            if reads:
                found[str(path.relative_to(ROOT))] = reads
    return found


def test_only_the_documented_variables_are_read_outside_the_config_module():
    unexpected = {path: sorted(reads - READ_ELSEWHERE) for path, reads in reads_outside_the_config_module().items()
                  if reads - READ_ELSEWHERE}
    assert unexpected == {}


def test_the_check_sees_reads_and_not_writes():
    source = ('import os\nfrom os import environ\n'
              'a = os.environ.get("DUALPACE_A", "1")\nb = os.getenv("DUALPACE_B")\nc = os.environ["DUALPACE_C"]\n'
              'd = "DUALPACE_D" in environ\nos.environ["DUALPACE_E"] = "1"\nenv = {"DUALPACE_F": "1"}\n')
    assert python_reads(source) == {"DUALPACE_A", "DUALPACE_B", "DUALPACE_C", "DUALPACE_D"}
    assert C_GETENV.findall('const char* v = std::getenv("DUALPACE_G");') == ["DUALPACE_G"]
    assert "dualpace_cli/main.py" in reads_outside_the_config_module()  # DUALPACE_TRACEBACK, read there
