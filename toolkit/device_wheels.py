"""The wheels the GPU check carries to the lent GPU machine, which reaches no package registry.

That machine (the `device` tool's nvidia-h200 kind) has Python 3.12 with torch 2.11 + CUDA, Triton,
numpy, tokenizers, jinja2, safetensors, aiohttp, uvloop, rich, prometheus-client, pytest and
hypothesis. What the project needs beyond that, or at another version (the generated gRPC stubs
need this venv's protobuf and grpcio), travels as wheels for CPython 3.12 manylinux x86-64:

    python -m toolkit.device_wheels --dest .whl      # what `make device-check` runs

prints the one command to run there. Every runtime dependency in pyproject.toml is either on the
machine already (ON_DEVICE) or carried (CARRIED); tests/test_device_wheels.py checks that.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

# On the GPU machine's image already (DEVELOPERS' device notes, KINDS.md), at versions that work.
ON_DEVICE = frozenset({"torch", "numpy", "safetensors", "tokenizers", "jinja2", "uvloop", "rich", "aiohttp",
                       "prometheus-client", "triton", "pytest", "hypothesis"})
# Carried at this venv's version: missing there, or needed at exactly the version the stubs were made with.
CARRIED = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "gguf", "structlog",
           "pytest-asyncio", "crc32c", "llguidance")
# The machine's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39): any of these tags runs there.
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                  "--target /tmp/site {dest}/*.whl && export PYTHONPATH=/tmp/site:$PWD && "
                  "PYTHONUNBUFFERED=1 python3 -m bench.device_check --out $OUT/device_check.json")


def pinned_requirements() -> list[str]:
    """NAME==VERSION for each carried package, at the version installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]


def download_command(requirement: str, dest: Path) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + [requirement]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    for requirement in pinned_requirements():
        print(f"device_wheels: {requirement}", file=sys.stderr, flush=True)
        done = subprocess.run(download_command(requirement, args.dest))
        if done.returncode != 0:
            print(f"device_wheels: no CPython 3.12 manylinux wheel of {requirement} was found", file=sys.stderr)
            return 1
    print(f"device_wheels: {len(list(args.dest.glob('*.whl')))} wheels in {args.dest}. On the GPU machine "
          f"(device tool, carry [\"{args.dest}\"]), run:\n"
          + DEVICE_COMMAND.format(dest=args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
