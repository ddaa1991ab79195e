"""The GPU check's wheel list covers every runtime dependency the GPU machine lacks."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from toolkit import device_wheels

ROOT = Path(__file__).resolve().parents[1]


def _dependency_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}


def test_every_runtime_dependency_is_on_the_device_or_carried():
    uncovered = _dependency_names() - device_wheels.ON_DEVICE - set(device_wheels.CARRIED)
    assert not uncovered, f"add to toolkit/device_wheels.py CARRIED or ON_DEVICE: {sorted(uncovered)}"


def test_carried_wheels_are_pinned_to_this_venv_for_cpython_312_manylinux(tmp_path):
    requirements = device_wheels.pinned_requirements()
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", r) for r in requirements)
    command = device_wheels.download_command(requirements[0], tmp_path)
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert any(p.startswith("manylinux") and p.endswith("x86_64") for p in command)
    assert "bench.device_check" in device_wheels.DEVICE_COMMAND and ".whl/*.whl" in device_wheels.DEVICE_COMMAND.format(dest=".whl")
