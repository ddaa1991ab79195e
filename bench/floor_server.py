"""What the gRPC floor benchmarks (bench.grpc_floor, bench.grpc_bulk_floor) share:
bytes through identity serializers, their server run as a subprocess of the same module (`--serve
...`) that prints its port on stdout and serves until its stdin closes, and how a result is left."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator


def identity(data: bytes) -> bytes:
    return data


@contextlib.contextmanager
def served(module: str, *serve_args: str) -> Iterator[str]:
    """`python -m <module> --serve <serve_args>` started and stopped; yields its 127.0.0.1 address."""
    process = subprocess.Popen([sys.executable, "-m", module, "--serve", *serve_args],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield f"127.0.0.1:{process.stdout.readline().strip()}"
    finally:
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def leave_result(result: dict, out_path: str | None) -> None:
    """Write the result as JSON to out_path (when given), and print it as one JSON line."""
    if out_path:
        with open(out_path, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    print(json.dumps(result))
