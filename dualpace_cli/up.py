"""`dualpace up`: run gpu_service, cpu_service and the router together on this machine.

    dualpace up                                  # default model, router on a free port
    dualpace up --port 50051 --policy gated      # NEO-like baseline on a fixed port
    dualpace up --policy gpu-only                # no cpu_service
    dualpace up --http-port 8000                 # the router's OpenAI-compatible HTTP API on a fixed port

Each daemon is a child process. The engines listen on Unix sockets in a private folder (mode
0700, sockets 0600: only this user reaches them; `--engine-listen tcp`: on free 127.0.0.1 ports
instead), the router on 127.0.0.1 (--port, --http-port). Their output is relayed with a prefix ("[gpu] ..."). When all three are serving it prints
their addresses and a ready line. Ctrl-C or SIGTERM stops them all (SIGTERM, then a kill after a
timeout) and exits 0. A daemon that exits by itself is restarted on the same address, as systemd's
Restart=on-failure would, after a backoff that doubles with each recent restart, while the others keep
running (the router continues an engine's requests on the other one and reconnects when it is back);
after --max-restarts restarts of one daemon within --restart-window-s, `up` stops the others and
exits 1 naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from dualpace.model.quant_kernels import add_quant_activations_argument
from dualpace.policy.policies import POLICY_NAMES, Policy, policy_help, traits
from dualpace_cli.restart_budget import DEFAULT_MAX_RESTARTS, DEFAULT_WINDOW_S, RestartBudget
from dualpace_cli.supervise import Child, supervise_once

START_TIMEOUT_S = 120.0  # loading the weights of a larger model takes a while
STOP_TIMEOUT_S = 20.0  # each daemon drains for up to DRAIN_GRACE_S, then flushes its streams for up to 5 s
DRAIN_GRACE_S = 10.0  # --grace-s of every daemon: running requests get this long to finish on Ctrl-C
POLL_S = 0.1
FORCE_AFTER_S = 1.0  # a second signal later than this kills the daemons instead of waiting


def register(subparsers) -> None:
    from dualpace.model.registry import DEFAULT_MODEL_NAME

    p = subparsers.add_parser("up", help="run gpu_service, cpu_service and the router on this machine")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, help="known name, Hugging Face folder or .gguf file")
    p.add_argument("--gpu-kv-blocks", type=int, default=None, help="gpu_service KV pool in blocks (default: its own)")
    p.add_argument("--cpu-kv-blocks", type=int, default=None, help="cpu_service KV pool in blocks (default: its own)")
    p.add_argument("--policy", default=Policy.DUALPACE.value, choices=POLICY_NAMES, help=policy_help())
    p.add_argument("--assist", default="auto", choices=["auto", "always", "never"],
                   help="cpu_service Dense Assist setting")
    p.add_argument("--port", type=int, default=0, help="the router's gRPC port on 127.0.0.1 (0: a free one)")
    p.add_argument("--http-port", type=int, default=0,
                   help="the router's OpenAI-compatible HTTP port on 127.0.0.1 (0: a free one)")
    p.add_argument("--threads-per-engine", type=int, default=None, help="torch intra-op threads of each engine")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                   help="both engines reuse the KV of prompt prefixes computed before")
    p.add_argument("--host-tier", default="on", choices=["on", "off"],
                   help="dualpace with --prefix-caching on and --engine-listen unix: gpu_service offers its cached "
                        "blocks to cpu_service's pool, and the router continues a conversation there when only "
                        "the CPU engine still holds its history")
    p.add_argument("--weights", default="native", choices=["native", "bf16", "fp32", "int8"],
                   help="native: a GGUF's quantized matrices stay in their block format (default); bf16/fp32: "
                        "dequantized at load; int8: quantized at load to Q8_0 (per group of 32)")
    add_quant_activations_argument(p)
    p.add_argument("--profile", default=None,
                   help="hardware profile JSON (`dualpace profile`) for cpu_service's mode choice and the router")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="the router's inter-token latency target (with --profile: admission by predicted ITL)")
    p.add_argument("--orphan-timeout-s", type=float, default=None,
                   help="both engines: abort a request whose reader (the router) went away unless a stream "
                        "re-attaches within this many seconds (default: the engines' own, 30)")
    p.add_argument("--engine-listen", default="unix", choices=["unix", "tcp"],
                   help="unix: the engines on Unix sockets only this user can reach (default); "
                        "tcp: on free 127.0.0.1 ports, reachable by every local user")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="restarts of one daemon that exits by itself allowed within --restart-window-s, "
                        "then `up` gives up and exits 1 (0: never restart)")
    p.add_argument("--restart-window-s", type=float, default=DEFAULT_WINDOW_S,
                   help="the window --max-restarts counts in, in seconds")


class Console:
    """Whole lines on stdout from several threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def line(self, text: str, stream=None) -> None:
        stream = stream or sys.stdout
        with self.lock:
            try:
                stream.write(text + "\n")
                stream.flush()
            except (BrokenPipeError, ValueError):  # nobody reads our output any more: keep draining the daemons'
                pass


class Stopping(Exception):
    """A stop signal arrived while the daemons were starting."""


class ChildFailed(Exception):
    """A daemon did not start."""

    def __init__(self, child: Child, problem: str) -> None:
        super().__init__(f"{child.module} {problem}")
        self.child = child


class Up:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.console = Console()
        self.children: list[Child] = []
        self.signalled: int | None = None
        self.signalled_at = 0.0
        self.force = False  # a second signal: kill instead of waiting for a clean exit
        self.socket_folder: str | None = None  # the engines' Unix sockets (--engine-listen unix)

    # ---- signals: the handler only records; the main thread polls ----

    def on_signal(self, signum, frame) -> None:
        if self.signalled is None:
            self.signalled, self.signalled_at = signum, time.monotonic()
        elif time.monotonic() - self.signalled_at > FORCE_AFTER_S:  # not a duplicate of the first one
            self.force = True

    # ---- starting ----

    def spawn(self, name: str, module: str, *argv: str) -> Child:
        budget = RestartBudget(max_restarts=self.args.max_restarts, window_s=self.args.restart_window_s)
        child = Child(name, module, list(argv), budget)
        self.children.append(child)
        self.launch(child)
        return child

    def launch(self, child: Child) -> None:
        from dualpace.serve.readiness import LISTENING

        # A process group of its own: a terminal Ctrl-C reaches only `up`, which stops the
        # daemons in order with one SIGTERM each.
        process = subprocess.Popen(
            [sys.executable, "-m", child.module, *child.argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, process_group=0,
        )
        child.process = process
        child.listening.clear()
        child.http_listening.clear()

        def relay() -> None:
            for raw in process.stdout:
                line = raw.rstrip("\n")
                match = LISTENING.search(line)
                if match and " http listening on " in line:
                    if not child.http_listening.is_set():  # the first such line of this launch
                        child.http_address = match.group(1)
                        child.http_listening.set()
                elif match and not child.listening.is_set():
                    child.address = match.group(1)
                    child.listening.set()
                self.console.line(f"[{child.name}] {line}")

        child.relay = threading.Thread(target=relay, name=f"relay-{child.name}", daemon=True)
        child.relay.start()

    def wait_listening(self, child: Child) -> str:
        from dualpace.serve.readiness import wait_serving

        deadline = time.monotonic() + START_TIMEOUT_S
        while not child.listening.wait(POLL_S):
            if self.signalled is not None:
                raise Stopping
            if child.process.poll() is not None:
                raise ChildFailed(child, f"exited with status {child.process.returncode} before listening")
            if time.monotonic() > deadline:
                raise ChildFailed(child, f"did not print its address within {START_TIMEOUT_S:.0f} s")
        try:
            wait_serving(child.address)
        except RuntimeError:
            raise ChildFailed(child, f"listens on {child.address} but never reported SERVING") from None
        return child.address

    def start(self) -> str:
        """gpu_service, then cpu_service (it needs gpu_service's address), then the router; its address."""
        args = self.args
        engine_flags = ["--model", args.model, "--dtype", args.dtype, "--weights", args.weights,
                        "--quant-activations", args.quant_activations,
                        "--grace-s", str(DRAIN_GRACE_S),
                        "--prefix-caching", args.prefix_caching]
        if args.threads_per_engine is not None:
            engine_flags += ["--threads", str(args.threads_per_engine)]
        if args.orphan_timeout_s is not None:
            engine_flags += ["--orphan-timeout-s", str(args.orphan_timeout_s)]
        profile_flags = ["--profile", args.profile] if args.profile is not None else []
        gpu_flags = engine_flags + (["--kv-blocks", str(args.gpu_kv_blocks)] if args.gpu_kv_blocks else [])
        if self.host_tier_enabled():  # cpu_service's socket path is known before it starts
            gpu_flags += ["--host-tier", self.engine_listen("cpu")]
        policy = traits(args.policy)
        if policy.uses_cpu_engine:  # hand-offs and migrations go to cpu_service, whose address is fixed here
            gpu_flags += ["--peer", self.engine_peer("cpu")]
        gpu = self.wait_listening(self.spawn("gpu", "gpu_service", *gpu_flags, "--name", "gpu",
                                             "--listen", self.engine_listen("gpu")))
        cpu = None
        if policy.uses_cpu_engine:
            cpu_flags = engine_flags + (["--kv-blocks", str(args.cpu_kv_blocks)] if args.cpu_kv_blocks else [])
            cpu = self.wait_listening(self.spawn(
                "cpu", "cpu_service", *cpu_flags, "--name", "cpu", "--listen", self.engine_listen("cpu"),
                "--gpu-service", gpu, "--peer", gpu, "--assist", args.assist,
                "--policy", policy.cpu_service_policy.value, *profile_flags))
        router_flags = ["serve", "--gpu", gpu, "--policy", args.policy, "--model", args.model,
                        "--grace-s", str(DRAIN_GRACE_S),
                        "--listen", f"127.0.0.1:{args.port}", "--http-listen", f"127.0.0.1:{args.http_port}"]
        if cpu is not None:
            router_flags += ["--cpu", cpu, "--host-tier", "on" if self.host_tier_enabled() else "off"]
        router_flags += profile_flags
        if args.itl_target_ms is not None:
            router_flags += ["--itl-target-ms", str(args.itl_target_ms)]
        router = self.spawn("router", "router", *router_flags)
        address = self.wait_listening(router)
        # The router prints its HTTP line right after the gRPC one.
        deadline = time.monotonic() + START_TIMEOUT_S
        while not router.http_listening.wait(POLL_S):
            if self.signalled is not None:
                raise Stopping
            if router.process.poll() is not None or time.monotonic() > deadline:
                raise ChildFailed(router, "did not start its HTTP API")
        return address

    def host_tier_enabled(self) -> bool:
        args = self.args
        return (getattr(args, "host_tier", "on") == "on" and traits(args.policy).continues_on_host_tier
                and args.prefix_caching == "on" and args.engine_listen == "unix")

    def engine_listen(self, name: str) -> str:
        if self.args.engine_listen == "tcp":
            return "127.0.0.1:0"
        if self.socket_folder is None:
            import tempfile

            self.socket_folder = tempfile.mkdtemp(prefix="dualpace-up-")  # mode 0700
        return f"unix:{os.path.join(self.socket_folder, name + '.sock')}"

    def engine_peer(self, name: str) -> str:
        """The --peer naming engine `name` before it starts: its socket path, or with
        --engine-listen tcp any 127.0.0.1 port (it takes a free one at bind)."""
        listen = self.engine_listen(name)
        return "127.0.0.1:*" if listen.endswith(":0") else listen

    def remove_socket_folder(self) -> None:
        if self.socket_folder is not None:
            import shutil

            shutil.rmtree(self.socket_folder, ignore_errors=True)

    # ---- running and stopping ----

    def watch(self) -> Child | None:
        """Supervise until a stop signal (None) or a daemon has spent its restart budget (that daemon)."""
        while self.signalled is None:
            gave_up = supervise_once(self, time.monotonic())
            if gave_up is not None:
                return gave_up
            time.sleep(POLL_S)
        return None

    def stop_all(self) -> list[Child]:
        """Router first (it stops relaying), then the engines; SIGTERM, wait, kill after the timeout.
        Returns the daemons that did not exit cleanly (non-zero status or killed)."""
        unclean: list[Child] = []
        router = [c for c in self.children if c.module == "router"]
        engines = [c for c in self.children if c.module != "router"]
        for group in (router, engines):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while any(c.process.poll() is None for c in group) and time.monotonic() < deadline and not self.force:
                time.sleep(POLL_S)
            for child in group:
                if child.process.poll() is None:
                    self.console.line(f"dualpace up: {child.module} did not stop; killing it", sys.stderr)
                    child.process.kill()
                    child.process.wait()
                    unclean.append(child)
                elif child.process.returncode not in (0, -signal.SIGTERM) and not child.exit_handled:
                    unclean.append(child)  # -SIGTERM: still starting up; exit_handled: reported already
        for child in self.children:  # relay their last lines before `up` reports
            child.relay.join(timeout=2.0)
        return unclean


def check_args(args: argparse.Namespace) -> None:
    """Refuses bad flags before any daemon starts (a missing model would otherwise be found by
    gpu_service, after its start)."""
    from dualpace.errors import InvalidArgument
    from dualpace.model.registry import resolve_model_path

    resolve_model_path(args.model)  # ModelLoadError naming the model
    for name in ("gpu_kv_blocks", "cpu_kv_blocks", "threads_per_engine"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')}", f"must be >= 1, got {value}")
    if not 0 <= args.port <= 65535:
        raise InvalidArgument("--port", f"must be in 0..65535, got {args.port}")
    if not 0 <= args.http_port <= 65535:
        raise InvalidArgument("--http-port", f"must be in 0..65535, got {args.http_port}")
    if args.orphan_timeout_s is not None and not args.orphan_timeout_s > 0:
        raise InvalidArgument("--orphan-timeout-s", f"must be > 0, got {args.orphan_timeout_s}")
    if args.max_restarts < 0:
        raise InvalidArgument("--max-restarts", f"must be >= 0, got {args.max_restarts}")
    if not args.restart_window_s > 0:
        raise InvalidArgument("--restart-window-s", f"must be > 0, got {args.restart_window_s}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    up = Up(args)
    previous = {signum: signal.signal(signum, up.on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        try:
            router = up.start()
        except Stopping:
            pass
        except ChildFailed as exc:
            up.console.line(f"dualpace up: error: {exc}", sys.stderr)
            status = 1
        else:
            for child in up.children:
                up.console.line(f"dualpace up: {child.module} on {child.address} (pid {child.process.pid})")
                if child.http_address is not None:
                    up.console.line(f"dualpace up: OpenAI-compatible HTTP API on http://{child.http_address}/v1")
            up.console.line(f"dualpace up: ready; router on {router} "
                            f"(try: dualpace client --router {router} --chat \"Hello\"; Ctrl-C stops)")
            exited = up.watch()
            if exited is not None:
                up.console.line(f"dualpace up: error: {exited.module} exited unexpectedly with status "
                                f"{exited.process.returncode} after {exited.budget.num_recent} restarts within "
                                f"{exited.budget.window_s:g} s; giving up and stopping the others", sys.stderr)
                status = 1
    finally:
        unclean = up.stop_all()
        up.remove_socket_folder()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if status == 0 and unclean:
        names = ", ".join(f"{c.module} (status {c.process.returncode})" for c in unclean)
        up.console.line(f"dualpace up: error: not stopped cleanly: {names}", sys.stderr)
        status = 1
    if status == 0:
        up.console.line("dualpace up: stopped")
    return status
