"""Two DualPace nodes behind NVIDIA Dynamo's frontend, as real processes (`dualpace cluster up`),
on the tiny synthetic model with one thread per engine and prefix caching on, the frontend's KV
router fed by the workers' KV events, through the official `openai` client: requests spread over
both nodes; greedy outputs equal `dualpace generate`; bad input is a clear 400 and the workers stay
up; repeated long prefixes land on the node that holds them; an engine restart withdraws its
blocks and its events flow again; a node SIGKILLed mid-stream leaves no request hanging and new
requests go to the survivor. Which node served a request is read from the nodes' own logs (the
router logs Dynamo's request id, which the completion id carries).

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
from dualpace_cli.main import main

READY = re.compile(r"dualpace cluster: ready; \d+ nodes behind (\S+)/v1 \(model (\S+);")
NODE = re.compile(r"dualpace cluster: node (\d+): router (\S+) \(http (\S+)\), worker metrics (\S+), pids (.*)")
START_TIMEOUT_S = 400.0
REQUEST_TIMEOUT_S = 120.0  # the bound on every request: a hang fails the test instead of blocking it
PROMPTS = ["hello world", "The capital of France", "one two three four", "a b c", "tiny models say", "why"]


class Cluster:
    def __init__(self, model: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dualpace", "cluster", "up", "--nodes", "2", "--model", model,
             "--http-port", str(_free_port()), "--router-mode", "kv",
             # Without the host tier a killed GPU engine's blocks are held by no other engine, so the
             # restart test can see every one of them withdrawn at the frontend.
             "--node-args=--host-tier off"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.output: deque[str] = deque(maxlen=20000)
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

    def node_of(self, completion_id: str) -> int:
        """The node whose router took the request (bounded wait for its log line)."""
        request_id = completion_id.removeprefix("cmpl-").removeprefix("chatcmpl-")
        pattern = re.compile(r'^\[node(\d+)\] \[router\] .*"request_id": "' + re.escape(request_id) + '"')
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in list(self.output):
                if match := pattern.match(line):
                    return int(match.group(1))
            time.sleep(0.1)
        raise AssertionError(f"no node logged request {request_id}")

    def frontend_sum(self, name: str, labels: str = "") -> float:
        """The sum of the frontend's /metrics samples of `name` whose labels contain `labels`."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and labels in line)

    def num_lines(self, needle: str) -> int:
        return sum(1 for line in list(self.output) if needle in line)

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
def cluster(tiny_folder):
    running = Cluster(tiny_folder)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def dualpace_generate(capsys, model: str, prompt: str, max_tokens: int) -> dict:
    """`dualpace generate --json`, run in this process (a process of its own per prompt cost seconds)."""
    capsys.readouterr()
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-tokens", str(max_tokens), "--threads", "1",
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[0])


def test_the_model_is_registered_by_both_workers(cluster, client):
    assert [m.id for m in client.models.list().data] == [cluster.model]
    assert sorted(cluster.nodes) == [0, 1]


def test_greedy_outputs_through_the_frontend_equal_dualpace_generate(cluster, client, tiny_folder, capsys):
    before = [cluster.requests_served(i) for i in (0, 1)]
    for prompt in PROMPTS:
        answer = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=12, temperature=0)
        expected = dualpace_generate(capsys, tiny_folder, prompt, 12)
        assert answer.choices[0].text == expected["text"], prompt
        assert answer.usage.prompt_tokens == len(expected["prompt_token_ids"])
        assert answer.usage.completion_tokens == len(expected["token_ids"])
        assert answer.choices[0].finish_reason == expected["finish_reason"]
    served = [cluster.requests_served(i) - before[i] for i in (0, 1)]
    print(f"requests per node over {len(PROMPTS)} sequential completions (KV router, no shared prefix): {served}")
    assert sum(served) == len(PROMPTS)


def test_requests_spread_over_both_nodes_by_their_load(cluster, client):
    """Without a shared prefix the KV router weighs the nodes' active blocks: a request sent while
    another streams goes to the other node, whichever that one is."""
    prompt = " ".join(PROMPTS)
    stream = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    second = client.completions.create(model=cluster.model, prompt="why " + prompt, max_tokens=4, temperature=0)
    for _ in stream:
        pass
    assert {cluster.node_of(first.id), cluster.node_of(second.id)} == {0, 1}


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


# Three long prefixes (about 270 tokens of the tiny model, 17 blocks of 16), distinct from their first token.
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango").split()
PREFIXES = [" ".join(_WORDS[i:] + _WORDS[:i]) * 3 for i in (0, 7, 13)]
# Repeats in an order no alternation of two nodes follows.
REPEATS = [0, 0, 1, 2, 1, 1, 0, 2, 2, 0, 1, 2]
STORED_OK = ("dynamo_component_kv_cache_events_applied", 'event_type="stored",status="ok"')
REMOVED_OK = ("dynamo_component_kv_cache_events_applied", 'event_type="removed",status="ok"')


def _complete(client, cluster, prompt: str) -> int:
    answer = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")
    return cluster.node_of(answer.id)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def test_repeated_prefixes_land_on_the_node_that_holds_them(cluster, client):
    stored_before = cluster.frontend_sum(*STORED_OK)
    # First sight of each prefix. The first two overlap in time, so the load-aware choice puts them
    # on different nodes (both nodes then hold a prefix); the third goes wherever.
    stream = client.completions.create(model=cluster.model, prompt=PREFIXES[0] + " start", max_tokens=120,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    holder = {1: _complete(client, cluster, PREFIXES[1] + " start")}
    for _ in stream:
        pass
    holder[0] = cluster.node_of(first.id)
    holder[2] = _complete(client, cluster, PREFIXES[2] + " start")
    assert {holder[0], holder[1]} == {0, 1}, holder
    # The engines' stored events went through the workers' publishers to the frontend's KV router.
    _wait_for(lambda: cluster.frontend_sum(*STORED_OK) - stored_before >= 3, "the stored events at the frontend")
    hit_rate_before = (cluster.frontend_sum("dynamo_component_router_kv_hit_rate_sum"),
                       cluster.frontend_sum("dynamo_component_router_kv_hit_rate_count"))
    landed = [_complete(client, cluster, f"{PREFIXES[p]} again {n}") for n, p in enumerate(REPEATS)]
    hits = sum(node == holder[p] for node, p in zip(landed, REPEATS))
    rate_sum = cluster.frontend_sum("dynamo_component_router_kv_hit_rate_sum") - hit_rate_before[0]
    rate_count = cluster.frontend_sum("dynamo_component_router_kv_hit_rate_count") - hit_rate_before[1]
    print(f"prefix holders {holder}; {hits} of {len(REPEATS)} repeats on the holder ({landed}); Dynamo's "
          f"router KV hit rate over them {rate_sum / max(rate_count, 1):.2f}; requests per node "
          f"{[landed.count(i) for i in (0, 1)]}")
    assert hits == len(REPEATS), (holder, landed)
    assert rate_count >= len(REPEATS) and rate_sum / rate_count > 0.5  # most of each prompt was cached


def test_an_engine_restart_withdraws_its_blocks_and_its_events_flow_again(cluster, client):
    """SIGKILL node 0's gpu_service: its KV event stream breaks, the worker withdraws the engine's
    blocks from Dynamo's index (removed events reach the frontend), `dualpace up` restarts the
    engine, the worker reconnects and the new snapshot flows; the node keeps serving."""
    removed_before = cluster.frontend_sum(*REMOVED_OK)
    flowing = "[worker0]", "flowing again"
    flowing_before = sum(1 for line in list(cluster.output) if all(part in line for part in flowing))
    os.kill(cluster.nodes[0]["pids"]["gpu_service"], signal.SIGKILL)
    _wait_for(lambda: cluster.frontend_sum(*REMOVED_OK) > removed_before, "the withdrawn blocks at the frontend")
    _wait_for(lambda: sum(1 for line in list(cluster.output) if all(part in line for part in flowing))
              > flowing_before, "node 0's GPU engine's KV events after its restart")
    for prompt in PREFIXES:
        _complete(client, cluster, prompt + " after the restart")


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
