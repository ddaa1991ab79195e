"""Two DualPace nodes behind NVIDIA Dynamo's frontend, as real processes (`dualpace cluster up`),
on the tiny synthetic model with one thread per engine, through the official `openai` client:
requests spread over both nodes; greedy outputs equal `dualpace generate`; bad input is a clear
400 and the workers stay up; a node SIGKILLed mid-stream leaves no request hanging and new
requests go to the survivor.

Needs the [dynamo] extra (make venv installs it); without it the module says so and skips."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque

import pytest

try:
    import dynamo.common.backend  # noqa: F401
    import dynamo.frontend  # noqa: F401
except ImportError as exc:
    pytest.skip(f"NVIDIA Dynamo is not installed (the [dynamo] extra, ai-dynamo==1.6.1 with --no-deps; "
                f"`make venv` installs it): {exc}", allow_module_level=True)

import openai

from dualpace_cli.cluster import _free_port

READY = re.compile(r"dualpace cluster: ready; \d+ nodes behind (\S+)/v1 \(model (\S+);")
NODE = re.compile(r"dualpace cluster: node (\d+): router (\S+) \(http (\S+)\), worker metrics (\S+), pids (.*)")
START_TIMEOUT_S = 400.0
REQUEST_TIMEOUT_S = 120.0  # the bound on every request: a hang fails the test instead of blocking it
PROMPTS = ["hello world", "The capital of France", "one two three four", "a b c", "tiny models say", "why"]


class Cluster:
    def __init__(self, model: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dualpace", "cluster", "up", "--nodes", "2", "--model", model,
             "--http-port", str(_free_port())],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.output: deque[str] = deque(maxlen=3000)
        self.nodes: dict[int, dict] = {}
        self.ready = threading.Event()
        self.url = self.model = None
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S) or self.url is None:
            self.stop()
            raise RuntimeError("dualpace cluster up did not get ready:\n" + "".join(self.output))

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            if match := NODE.search(line):
                pids = dict(item.split("=") for item in match.group(5).split())
                self.nodes[int(match.group(1))] = {"router": match.group(2), "http": match.group(3),
                                                   "worker_metrics": match.group(4),
                                                   "pids": {name: int(pid) for name, pid in pids.items()}}
            elif match := READY.search(line):
                self.url, self.model = match.group(1), match.group(2)
                self.ready.set()
        self.ready.set()

    def requests_served(self, index: int) -> float:
        """dualpace_requests_total on the node's router (all engines and finish reasons)."""
        with urllib.request.urlopen(f"http://{self.nodes[index]['http']}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("dualpace_requests_total{"))

    def kill_node(self, index: int) -> None:
        """The host dies: SIGKILL its engines, its router and its worker at once."""
        for pid in self.nodes[index]["pids"].values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def tiny_folder(synth_checkpoint):
    return synth_checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def cluster(tiny_folder):
    running = Cluster(str(tiny_folder))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def dualpace_generate(model: str, prompt: str, max_tokens: int) -> dict:
    result = subprocess.run([sys.executable, "-m", "dualpace", "generate", "--model", model, "--prompt", prompt,
                             "--max-tokens", str(max_tokens), "--threads", "1", "--json"],
                            capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.splitlines()[0])


def test_the_model_is_registered_by_both_workers(cluster, client):
    assert [m.id for m in client.models.list().data] == [cluster.model]
    assert sorted(cluster.nodes) == [0, 1]


def test_requests_spread_over_both_nodes_and_greedy_equals_dualpace_generate(cluster, client, tiny_folder):
    before = [cluster.requests_served(i) for i in (0, 1)]
    for prompt in PROMPTS:
        answer = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=12, temperature=0)
        expected = dualpace_generate(str(tiny_folder), prompt, 12)
        assert answer.choices[0].text == expected["text"], prompt
        assert answer.usage.prompt_tokens == len(expected["prompt_token_ids"])
        assert answer.usage.completion_tokens == len(expected["token_ids"])
        assert answer.choices[0].finish_reason == expected["finish_reason"]
    served = [cluster.requests_served(i) - before[i] for i in (0, 1)]
    print(f"requests per node over {len(PROMPTS)} completions: {served}")
    assert sum(served) == len(PROMPTS) and min(served) >= 1


def test_streamed_chat_through_the_frontend(cluster, client):
    stream = client.chat.completions.create(model=cluster.model, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["length"], ["stop"])


def test_bad_input_is_a_clear_400_and_the_workers_stay_up(cluster, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=cluster.model, prompt="hello", max_tokens=4, n=2)
    assert "sampling_options.n" in str(caught.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=cluster.model, prompt="hello", max_tokens=4, extra_body={"min_tokens": 3})
    for _ in range(2):  # one per node with round-robin: both still answer
        assert client.completions.create(model=cluster.model, prompt="hello", max_tokens=3, temperature=0).choices


def test_a_client_that_goes_away_aborts_the_request_in_its_engine(cluster, client):
    """Closing the stream early: Dynamo calls the worker's abort, the router call is cancelled, and
    the engine logs the abort of that very request (the completion id carries Dynamo's request id)."""
    stream = client.completions.create(model=cluster.model, prompt="hello", max_tokens=450, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    request_id = first.id.removeprefix("cmpl-")
    stream.close()
    wanted = f'"event": "abort", "request_id": "{request_id}"'
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while not any(wanted in line for line in list(cluster.output)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(wanted in line for line in list(cluster.output)), f"no abort of {request_id} in the engines' logs"


def _worker_gauges(cluster, index: int) -> dict[str, float]:
    """The worker's /metrics (Dynamo's status server) as {name{selected labels}: value}."""
    with urllib.request.urlopen(cluster.nodes[index]["worker_metrics"], timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if match := re.match(r'^([a-z_:]+)\{(.*)\} (\S+)$', line):
            keep = ",".join(label for label in match.group(2).split(",") if label.startswith(("state=", "tier=")))
            values[f"{match.group(1)}{{{keep}}}" if keep else match.group(1)] = float(match.group(3))
    return values


def test_workers_publish_the_node_load_where_dynamo_reads_it(cluster, client):
    """Dynamo's per-worker gauges (from the snapshot publisher: the GPU tier's blocks) and the
    node's load under dualpace_ and vLLM names, while long requests run (four, so that they outlast
    a few of the worker's load polls on any machine)."""
    def long_request() -> None:
        client.completions.create(model=cluster.model, prompt="hello", max_tokens=450, temperature=0,
                                  extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=long_request, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    seen = None
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while seen is None and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        for index in (0, 1):
            gauges = _worker_gauges(cluster, index)
            if gauges.get('dualpace_node_requests{state="running"}', 0) >= 1:
                seen = gauges
        time.sleep(0.1)
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S)
    assert seen is not None, "no worker reported the running request"
    assert seen["vllm:num_requests_running"] >= 1
    assert seen["dynamo_component_total_blocks"] > 0
    assert 0.0 < seen['dualpace_node_kv_usage_ratio{tier="gpu"}'] <= 1.0 or \
        0.0 < seen['dualpace_node_kv_usage_ratio{tier="host"}'] <= 1.0
    assert seen["vllm:kv_cache_usage_perc"] == seen['dualpace_node_kv_usage_ratio{tier="gpu"}']


def test_a_node_killed_mid_stream_never_hangs_a_request_and_new_ones_go_to_the_survivor(cluster, client):
    outcomes: dict[int, str] = {}
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        try:
            for chunk in client.completions.create(model=cluster.model, prompt=PROMPTS[i], max_tokens=400,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                started[i].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcomes[i] = f"finished {chunk.choices[0].finish_reason}"
            outcomes.setdefault(i, "ended without a finish reason")
        except openai.APIError as exc:  # an explicit error is fine; silence or a hang is not
            outcomes[i] = f"error {type(exc).__name__}"
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(REQUEST_TIMEOUT_S)
    cluster.kill_node(1)
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), f"a request hung; outcomes so far {outcomes}"
    print(f"in-flight requests when node 1 was killed: {outcomes}")
    assert all(o.startswith(("finished", "error")) for o in outcomes.values()), outcomes
    assert any(o.startswith("finished") for o in outcomes.values())  # node 0's streams were not disturbed

    before = cluster.requests_served(0)
    for prompt in PROMPTS[:4]:
        answer = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=6, temperature=0)
        assert answer.choices[0].finish_reason in ("length", "stop")
    assert cluster.requests_served(0) - before == 4
