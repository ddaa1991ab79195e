"""What the router's end-to-end modules share: one `dualpace up` on the tiny model, with a
tool-calling chat template."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from tests.helpers import wait_for

READY = re.compile(r"dualpace up: ready; router on (\S+)")
HTTP = re.compile(r"dualpace up: OpenAI-compatible HTTP API on (\S+)")
CHILD = re.compile(r"dualpace up: (\S+) on (\S+) \(pid (\d+)\)")
START_TIMEOUT_S = 180.0  # generous: the daemons start slowly on a loaded machine
STEP_DELAY_MS = 10  # slows every engine step, so a long stream outlives the client that drops it
GPU_KV_BLOCKS = 240
# The tiny checkpoint's chat template with tools (ChatML, Hermes-style <tool_call> blocks).
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. For each call, write <tool_call>{"name": ..., "arguments": ...}</tool_call>.
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@dataclass
class RunningUp:
    """A running `dualpace up`: its router's gRPC address and OpenAI base URL, each child's pid
    and address (by module: gpu_service, cpu_service, router) and every line it printed."""

    process: subprocess.Popen
    router: str = ""
    http: str = ""
    child_pids: dict[str, int] = field(default_factory=dict)
    child_addresses: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.lines)


@contextmanager
def running_up(model_folder: str) -> Iterator[RunningUp]:
    """`dualpace up` on the model, its steps slowed by STEP_DELAY_MS and its GPU pool at
    GPU_KV_BLOCKS (not the default, so that a test sees the flag arrive); at the end SIGTERM:
    `up` must exit 0 and no child outlive it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dualpace", "up", "--model", model_folder, "--dtype", "fp32",
         "--threads-per-engine", "1", "--gpu-kv-blocks", str(GPU_KV_BLOCKS)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "DUALPACE_FAULT_STEP_DELAY_MS": str(STEP_DELAY_MS)})
    running = RunningUp(process)
    ready = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            running.lines.append(line)
            if match := CHILD.search(line):
                running.child_addresses[match.group(1)] = match.group(2)
                running.child_pids[match.group(1)] = int(match.group(3))
            if match := HTTP.search(line):
                running.http = match.group(1)
            if match := READY.search(line):
                running.router = match.group(1)
                ready.set()
        ready.set()

    pump_thread = threading.Thread(target=pump, daemon=True)
    pump_thread.start()
    if not ready.wait(START_TIMEOUT_S) or not running.router or not running.http:
        process.kill()
        pytest.fail("dualpace up never became ready with an HTTP API:\n" + running.log())
    yield running
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(30) == 0, running.log()
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    pump_thread.join(5)
    assert "dualpace up: stopped" in running.log()
    for pid in running.child_pids.values():
        assert not wait_for(lambda: alive(pid), lambda is_alive: not is_alive, 5.0), f"child {pid} outlived dualpace up"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="package")
def model_folder(synth_checkpoint, tmp_path_factory) -> str:
    """The tiny model with TOOL_TEMPLATE as its chat template: what this package's daemons serve
    (one `dualpace up` for the plain and the tool-calling HTTP tests)."""
    folder = tmp_path_factory.mktemp("tiny-llama-tools") / "model"
    shutil.copytree(synth_checkpoint("tiny-llama"), folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE, encoding="utf-8")
    return str(folder)


@pytest.fixture(scope="package")
def up(model_folder):
    """One `dualpace up` for the package's modules (a module that needs another `dualpace up`
    defines its own `up`)."""
    with running_up(model_folder) as running:
        yield running
