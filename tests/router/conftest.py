"""What the router's end-to-end modules share: one `dualpace up` on the tiny model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

READY = re.compile(r"dualpace up: ready; router on (\S+)")
HTTP = re.compile(r"dualpace up: OpenAI-compatible HTTP API on (\S+)")
START_TIMEOUT_S = 180.0  # generous: the daemons start slowly on a loaded machine
STEP_DELAY_MS = 10  # slows every engine step, so a long stream outlives the client that drops it


@contextmanager
def running_up(model_folder: str) -> Iterator[dict[str, str]]:
    """`dualpace up` on the model: {"router": its gRPC address, "http": its OpenAI base URL}; at the
    end SIGTERM, and it must exit 0."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dualpace", "up", "--model", model_folder, "--dtype", "fp32",
         "--threads-per-engine", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "DUALPACE_FAULT_STEP_DELAY_MS": str(STEP_DELAY_MS)})
    found: dict[str, str] = {}
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            lines.append(line)
            if match := HTTP.search(line):
                found["http"] = match.group(1)
            if match := READY.search(line):
                found["router"] = match.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(START_TIMEOUT_S) or "router" not in found or "http" not in found:
        process.kill()
        pytest.fail("dualpace up never became ready with an HTTP API:\n" + "".join(lines))
    yield found
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(30) == 0, "".join(lines)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture(scope="package")
def up(tiny_folder):
    """One `dualpace up` for the modules that serve the tiny model as it is (a module that needs
    another `dualpace up` defines its own `up`)."""
    with running_up(tiny_folder) as found:
        yield found
