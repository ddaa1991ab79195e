"""`dualpace cluster up`: N local DualPace nodes behind NVIDIA Dynamo's frontend, on loopback.

    dualpace cluster up --nodes 2                       # default model, frontend on port 8000
    dualpace cluster up --nodes 2 --model ./tiny --http-port 0

Each node is a `dualpace up` (gpu_service + cpu_service + router, one torch thread per engine
unless --threads-per-engine says otherwise) with a `dualpace-dynamo` worker in front of its
router, which also follows the node's engines' KV events (--engine, their addresses as `up`
prints them); the frontend (`python -m dynamo.frontend`) finds the workers through Dynamo's file
discovery in a private folder, serves the OpenAI API and routes with its KV router by default
(--router-mode kv: to the node that holds the longest prefix of the prompt, weighed against load). For a GGUF model the frontend's
tokenizer folder is written first (`dualpace model export --tokenizer-only`). When every worker
is registered it prints one line per node and a ready line with the frontend's URL. Ctrl-C or
SIGTERM stops everything (frontend, workers, nodes) and exits 0. A node that dies is reported and
the others go on serving; when the frontend or the last node exits, the rest are stopped and it
exits 1 naming it. For trying it out and for tests; several hosts:
docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 300.0  # N nodes load their weights on shared cores
STOP_TIMEOUT_S = 40.0  # a node's `dualpace up` drains its daemons for up to 20 s each
POLL_S = 0.2
# Dynamo binds its request plane to the host's address unless told otherwise: keep it on loopback.
LOOPBACK_ENV = {"DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1"}
DYN_SYSTEM_PORT_LIMIT = 32768  # Dynamo 1.6.1 parses DYN_SYSTEM_PORT as a signed 16-bit number
NODE_READY = re.compile(r"dualpace up: ready; router on (\S+)")
NODE_HTTP = re.compile(r"dualpace up: OpenAI-compatible HTTP API on http://(\S+)/v1")
DAEMON_PID = re.compile(r"dualpace up: (gpu_service|cpu_service|router) on (\S+) \(pid (\d+)\)")


def register(subparsers) -> None:
    from dualpace.model.registry import DEFAULT_MODEL_NAME

    p = subparsers.add_parser("cluster", help="N local nodes behind NVIDIA Dynamo's frontend (needs the [dynamo] extra)")
    actions = p.add_subparsers(dest="cluster_command", required=True, metavar="{up}")
    up = actions.add_parser("up", help="start N nodes, a Dynamo worker per node and the Dynamo frontend")
    up.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    up.add_argument("--model", default=DEFAULT_MODEL_NAME, help="known name, Hugging Face folder or .gguf file")
    up.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the model's)")
    up.add_argument("--http-port", type=int, default=8000, help="the frontend's port on 127.0.0.1 (0: a free one)")
    up.add_argument("--threads-per-engine", type=int, default=1, help="torch intra-op threads of each engine")
    up.add_argument("--router-mode", default="kv",
                    choices=["kv", "round-robin", "random", "power-of-two", "least-loaded"],
                    help="how the frontend picks a worker (default kv: Dynamo's KV-aware router, fed the "
                         "engines' KV events and the nodes' load)")
    up.add_argument("--migration-limit", type=int, default=3,
                    help="how often the frontend may move a request to another worker when its node fails "
                         "(Dynamo's --migration-limit; 0: never, the client gets the error)")
    up.add_argument("--node-args", default="", help="extra flags for each node's `dualpace up`, one string")


@dataclass
class Proc:
    name: str  # output prefix: node0, worker0, frontend
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    changed: threading.Event = field(default_factory=threading.Event)


@dataclass
class Node:
    index: int
    up: Proc
    router: str | None = None
    router_http: str | None = None
    daemon_pids: dict[str, int] = field(default_factory=dict)
    engine_addresses: list[str] = field(default_factory=list)
    worker: Proc | None = None
    metrics_port: int | None = None


class Failed(Exception):
    pass


class Cluster:
    def __init__(self, args: argparse.Namespace, discovery_dir: Path):
        self.args = args
        self.env = {**os.environ, **LOOPBACK_ENV, "DYN_FILE_KV": str(discovery_dir), "PYTHONUNBUFFERED": "1"}
        self.discovery_dir = discovery_dir
        self.procs: list[Proc] = []
        self.lock = threading.Lock()
        self.signalled = False

    def on_signal(self, signum, frame) -> None:
        self.signalled = True

    def say(self, text: str, stream=None) -> None:
        with self.lock:
            try:
                (stream or sys.stdout).write(text + "\n")
                (stream or sys.stdout).flush()
            except (BrokenPipeError, ValueError):
                pass

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**self.env, **(env or {})}, process_group=0)  # Ctrl-C reaches only `cluster`, which stops them in order
        proc = Proc(name, process)
        self.procs.append(proc)

        def relay() -> None:
            for raw in process.stdout:
                line = raw.rstrip("\n")
                proc.lines.append(line)
                proc.changed.set()
                self.say(f"[{name}] {line}")
            proc.changed.set()

        threading.Thread(target=relay, name=f"relay-{name}", daemon=True).start()
        return proc

    def wait_for(self, proc: Proc, pattern: re.Pattern, deadline: float) -> re.Match:
        seen = 0
        while True:
            for line in proc.lines[seen:]:
                seen += 1
                match = pattern.search(line)
                if match:
                    return match
            self.check(deadline, proc)
            proc.changed.wait(POLL_S)
            proc.changed.clear()

    def check(self, deadline: float, *watched: Proc) -> None:
        if self.signalled:
            raise Failed("")
        for proc in watched:
            if proc.process.poll() is not None:
                raise Failed(f"{proc.name} exited with status {proc.process.returncode} while starting")
        if time.monotonic() > deadline:
            raise Failed(f"not ready within {START_TIMEOUT_S:.0f} s")

    def start(self, model_path: Path, served_name: str) -> tuple[list[Node], str]:
        args = self.args
        deadline = time.monotonic() + START_TIMEOUT_S
        python = sys.executable
        nodes = []
        for index in range(args.nodes):
            argv = [python, "-m", "dualpace", "up", "--model", args.model, "--threads-per-engine",
                    str(args.threads_per_engine), *args.node_args.split()]
            nodes.append(Node(index, self.spawn(f"node{index}", argv)))
        for node in nodes:  # they load in parallel; collect their lines in order
            node.router_http = self.wait_for(node.up, NODE_HTTP, deadline).group(1)
            node.router = self.wait_for(node.up, NODE_READY, deadline).group(1)
            daemons = [m for line in node.up.lines if (m := DAEMON_PID.search(line))]
            node.daemon_pids = {m.group(1): int(m.group(3)) for m in daemons}
            node.engine_addresses = [m.group(2) for m in daemons if m.group(1) != "router"]
            node.metrics_port = _free_port(below=DYN_SYSTEM_PORT_LIMIT)  # the worker's status server: /metrics (load signals), /health
            node.worker = self.spawn(f"worker{node.index}", [
                python, "-m", "dynamo_worker", "--router", node.router, "--model-path", str(model_path),
                "--served-model-name", served_name, "--discovery-backend", "file",
                *(flag for address in node.engine_addresses for flag in ("--engine", address))],
                env={"DYN_SYSTEM_PORT": str(node.metrics_port)})
        frontend = self.spawn("frontend", [
            python, "-m", "dynamo.frontend", "--discovery-backend", "file", "--http-host", "127.0.0.1",
            "--http-port", str(args.http_port), "--router-mode", args.router_mode,
            "--migration-limit", str(args.migration_limit)])
        url = f"http://127.0.0.1:{args.http_port}"
        while not (self.num_registered() >= args.nodes and _lists_model(url, served_name)):
            self.check(deadline, frontend, *(n.worker for n in nodes))
            time.sleep(POLL_S)
        return nodes, url

    def num_registered(self) -> int:
        """Workers in the discovery folder (one instance file per worker of our component)."""
        folder = self.discovery_dir / "v1" / "instances"
        return sum(1 for p in folder.glob("*") if "dualpace%2Fgenerate" in p.name) if folder.is_dir() else 0

    def watch(self, nodes: list[Node]) -> Proc | None:
        """Until a stop signal (None), the frontend's exit or the last node's (that process). A node
        that dies (its `dualpace up` or its worker) is reported and the others go on serving: its
        worker unregisters from discovery once its router is gone, so the frontend stops routing there."""
        frontend = next(p for p in self.procs if p.name == "frontend")
        alive = {node.index: node for node in nodes}
        while not self.signalled:
            if frontend.process.poll() is not None:
                return frontend
            for index, node in list(alive.items()):
                exited = next((p for p in (node.up, node.worker) if p.process.poll() is not None), None)
                if exited is not None:
                    del alive[index]
                    self.say(f"dualpace cluster: node {index} lost ({exited.name} exited with status "
                             f"{exited.process.returncode}); {len(alive)} node(s) left", sys.stderr)
                    if not alive:
                        return exited
            time.sleep(POLL_S)
        return None

    def stop_all(self) -> None:
        """Frontend first, then the workers, then the nodes; SIGTERM, then a kill after the timeout."""
        order = ([p for p in self.procs if p.name == "frontend"], [p for p in self.procs if p.name.startswith("worker")],
                 [p for p in self.procs if p.name.startswith("node")])
        for group in order:
            for proc in group:
                if proc.process.poll() is None:
                    proc.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while any(p.process.poll() is None for p in group) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            for proc in group:
                if proc.process.poll() is None:
                    self.say(f"dualpace cluster: {proc.name} did not stop; killing it", sys.stderr)
                    proc.process.kill()
                    proc.process.wait()


def _lists_model(url: str, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
            return f'"{name}"' in reply.read().decode()
    except OSError:
        return False


def _free_port(below: int = 65536) -> int:
    """A port free on 127.0.0.1 now; `below` for Dynamo's DYN_SYSTEM_PORT, which it reads as an i16."""
    if below >= 65536:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in random.sample(range(20000, below), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port below {below} on 127.0.0.1")


def tokenizer_folder(model: str, scratch: Path) -> Path:
    """The Hugging Face-style folder the frontend reads: the model's own, or one exported from a GGUF."""
    from dualpace.model.registry import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return path.resolve()
    from dualpace.model.export import export_hf_folder

    return export_hf_folder(model, scratch / "tokenizer", tokenizer_only=True).resolve()


def check_args(args: argparse.Namespace) -> None:
    from dualpace.errors import DualPaceError, InvalidArgument

    if args.nodes < 1:
        raise InvalidArgument("--nodes", f"must be >= 1, got {args.nodes}")
    if args.migration_limit < 0:
        raise InvalidArgument("--migration-limit", f"must be >= 0, got {args.migration_limit}")
    if args.threads_per_engine < 1:
        raise InvalidArgument("--threads-per-engine", f"must be >= 1, got {args.threads_per_engine}")
    if not 0 <= args.http_port <= 65535:
        raise InvalidArgument("--http-port", f"must be in 0..65535, got {args.http_port}")
    try:
        import dynamo.frontend  # noqa: F401
        import dynamo.common.backend  # noqa: F401
    except ImportError as exc:
        raise DualPaceError(f"NVIDIA Dynamo is not installed ({exc}): run `make venv`, "
                            "or see docs/scale-out.md for the install") from None


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.http_port == 0:
        args.http_port = _free_port()
    scratch = Path(tempfile.mkdtemp(prefix="dualpace-cluster-"))
    cluster = Cluster(args, scratch / "discovery")
    previous = {signum: signal.signal(signum, cluster.on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        model_path = tokenizer_folder(args.model, scratch)
        given = Path(args.model)
        served = args.served_model_name or (given.stem if given.is_file() else given.name if given.is_dir() else args.model)
        nodes, url = cluster.start(model_path, served)
        for node in nodes:
            pids = " ".join(f"{name}={pid}" for name, pid in sorted(node.daemon_pids.items()))
            cluster.say(f"dualpace cluster: node {node.index}: router {node.router} (http {node.router_http}), "
                        f"worker metrics http://127.0.0.1:{node.metrics_port}/metrics, "
                        f"pids {pids} worker={node.worker.process.pid}")
        cluster.say(f"dualpace cluster: ready; {len(nodes)} nodes behind {url}/v1 (model {served}; try: curl "
                    f"{url}/v1/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{served}\", "
                    f"\"prompt\": \"Hello\", \"max_tokens\": 16}}'; Ctrl-C stops)")
        exited = cluster.watch(nodes)
        if exited is not None:
            cluster.say(f"dualpace cluster: error: {exited.name} exited with status {exited.process.returncode} "
                        "and nothing can serve; stopping the rest", sys.stderr)
            status = 1
    except Failed as exc:
        if str(exc):
            cluster.say(f"dualpace cluster: error: {exc}", sys.stderr)
            status = 1
    finally:
        cluster.stop_all()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(scratch, ignore_errors=True)
    if status == 0:
        cluster.say("dualpace cluster: stopped")
    return status
