"""What gpu_service and cpu_service share as daemons: flags, building the engine,
serving dualpace.v1.Engine (plus any extra services) until SIGINT/SIGTERM, and
leaving with a non-zero status if the engine's forward pass failed.

Life cycle, as systemd (Type=notify) sees it through dualpace.serve.sd_notify:

    STATUS=loading model -> load -> warm-up (one short request through the EngineCore,
    KV blocks back where they started) -> bind -> READY=1 -> WATCHDOG=1 from the step
    loop (after steps and while idle; a stalled step stops them) -> SIGTERM ->
    STOPPING=1, health NOT_SERVING, new requests UNAVAILABLE, running ones finish
    within --grace-s (then the rest are aborted) -> exit 0.

If a step raises (the forward pass failed), the engine cannot continue: every stream
ends with UNAVAILABLE, health turns NOT_SERVING, and the process exits with status 1
(systemd restarts it). A request whose logits are not finite ends alone (DATA_LOSS on
its stream) and the engine keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from dualpace.engine.core import EngineConfig, EngineCore, kv_pool_sizes
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.kv_shm_import import SharedKvPool
from dualpace.engine.transfer.kv_tcp_import import TcpDataServer
from dualpace.engine.runner import ModelRunner
from dualpace.engine.transfer.shm_segment import SharedKvMemory
from dualpace.engine.step_timeline import StepTimeline
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.errors import DualPaceError, InvalidArgument, ModelLoadError
from dualpace.faults import FaultConfig, add_fault_arguments
from dualpace.model import attention_backend
from dualpace.model.attention_backend import ATTENTION_BACKENDS, FUSED_KERNELS, KernelChoices
from dualpace.model.loader import LoadedModel
from dualpace.model.quant_activations import add_quant_activations_argument, use_config_activations
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams
from dualpace.serve.config import add_config_argument, effective_config
from dualpace.serve.engine_loop_metrics import PrometheusLoopMetrics
from dualpace.serve.engine_servicer import EngineServicer
from dualpace.serve.kv_shm_transport import KV_TRANSPORTS, SameHostKv
from dualpace.serve.event_loop import serve_forever
from dualpace.serve.logging_setup import configure_logging, get_logger
from dualpace.serve.metrics import add_metrics_argument, start_from_args
from dualpace.serve.orphan_lease import DEFAULT_ORPHAN_TIMEOUT_S
from dualpace.serve.peer_channels import PeerChannels
from dualpace.serve.peers import PeerList
from dualpace.serve.sd_notify import Notifier, watchdog_interval_s
from dualpace.serve.security import (
    TlsConfig,
    add_security_arguments,
    check_listen_security,
    security_from_args,
)
from dualpace.serve.address import data_socket_host
from dualpace.serve.server import print_listening, start_server
from dualpace.wire.v1 import engine_pb2_grpc

log = logging.getLogger(__name__)
ENGINE_SERVICE = "dualpace.v1.Engine"
DEFAULT_GRACE_S = 30.0
FLUSH_GRACE_S = 5.0  # after the drain: time for the last stream messages to leave
WARMUP_REQUEST_ID = "dualpace-warmup"
WARMUP_PROMPT_TOKENS = 4
WARMUP_MAX_TOKENS = 2


def add_engine_arguments(parser: argparse.ArgumentParser, default_name: str, default_kv_blocks: int) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="known name, Hugging Face folder or .gguf file")
    parser.add_argument("--name", default=default_name, help="engine name shown to the router and in logs")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--weights", default="native", choices=["native", "bf16", "fp32", "int8"], help="native: a GGUF's quantized matrices stay in their block format (default); bf16/fp32: dequantized at load; int8: quantized at load to Q8_0 (per group of 32)")
    add_quant_activations_argument(parser)
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, help=f"KV pool size in blocks (default {default_kv_blocks})")
    kv.add_argument("--kv-gb", type=float, help="KV pool size in GB (instead of --kv-blocks)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (decodes + prefill chunks)")
    parser.add_argument("--max-running", type=int, default=64, help="sequences per step")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before RESOURCE_EXHAUSTED")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                        help="reuse the KV of prompt prefixes computed before (automatic prefix caching)")
    parser.add_argument("--listen", default="127.0.0.1:0",
                        help="HOST:PORT; port 0 picks a free port; a non-loopback host needs --tls-cert/--tls-key")
    parser.add_argument("--peer", action="append", default=[], metavar="ADDR",
                        help="an engine this one may migrate requests to (HOST:PORT, unix:PATH, or HOST:* for "
                             "any port of HOST); repeat for each. MigrateOut or CopyPrefix to any other target is refused "
                             "with PERMISSION_DENIED; with no --peer every target is refused")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="on SIGTERM, how long running requests may take to finish before they are aborted")
    parser.add_argument("--orphan-timeout-s", type=float, default=DEFAULT_ORPHAN_TIMEOUT_S,
                        help="a request kept running for a reader that went away (the router) is aborted "
                             "unless a stream re-attaches within this many seconds")
    parser.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORTS,
                        help="KV migration data plane: auto (shared memory with engines on this host, a TCP "
                             "data socket to others) or tcp (the data socket even on this host; the KV pool stays "
                             "private). The data socket "
                             "listens on the --listen host (127.0.0.1 for unix:) at a port the kernel picks, "
                             "announced per transfer over gRPC; over TLS with --tls-cert")
    parser.add_argument("--step-timeline", default=None, metavar="PATH",
                        help="append one JSON line per engine step to PATH (when, mode, rows, joins; "
                             "written off the step thread): the input of bench/cooperative_timeline.py")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (JSON lines on stderr)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="paged attention: auto (the Triton kernel on CUDA, the gather path elsewhere), gather "
                             "(always the gather path, the kernel's reference) or triton (always the kernel)")
    parser.add_argument("--fused-kernels", default="auto", choices=FUSED_KERNELS,
                        help="RMSNorm (+ residual add) and RoPE: auto (Triton on CUDA), torch (the torch ops, or "
                             "the CPU kernels on a CPU) or triton (always Triton)")
    add_config_argument(parser)
    add_metrics_argument(parser)
    add_security_arguments(parser)
    add_fault_arguments(parser)


@dataclass
class EngineDaemonParts:
    loaded: LoadedModel
    loop: EngineLoop
    device_lock: threading.Lock
    kv_memory: SharedKvMemory | None = None  # the KV pool's shared segment (host pool, --kv-transport auto)
    # Set once the daemon's event loop runs, before extra services are added: the TLS settings
    # this daemon's own calls to its peers use, and the channels to them it keeps open.
    peer_tls: TlsConfig | None = None
    channels: PeerChannels | None = None
    data_socket: TcpDataServer | None = None  # the KV data socket, which Dense Assist from other hosts shares


def kv_blocks_from_args(args: argparse.Namespace, loaded: LoadedModel, default_kv_blocks: int) -> int:
    cfg = loaded.config
    if args.kv_gb is not None:
        if args.kv_gb <= 0:
            raise InvalidArgument("--kv-gb", f"must be positive, got {args.kv_gb}")
        bytes_per_block = 2 * cfg.num_layers * args.block_size * cfg.num_kv_heads * cfg.head_dim * loaded.model.dtype.itemsize
        return max(1, int(args.kv_gb * 1e9 // bytes_per_block))
    blocks = default_kv_blocks if args.kv_blocks is None else args.kv_blocks
    if blocks < 1:
        raise InvalidArgument("--kv-blocks", f"must be >= 1, got {blocks}")
    return blocks


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < 1:
            raise InvalidArgument(f"--{name}", f"must be >= 1, got {value}")


def build_engine(
    args: argparse.Namespace,
    kind: str,
    device: str,
    default_kv_blocks: int,
    make_runner: Callable[[LoadedModel, EngineConfig], ModelRunner] | None = None,
) -> EngineDaemonParts:
    import torch

    from dualpace.model.loader import load_model

    check_positive(args, "block-size", "max-batch-tokens", "max-running", "max-waiting", "threads")
    if args.threads:
        torch.set_num_threads(args.threads)
    attention_backend.configure(KernelChoices(args.attention_backend, args.fused_kernels))
    loaded = load_model(args.model, dtype=args.dtype, device=device, weights=args.weights)
    use_config_activations(args.quant_activations)
    config = EngineConfig(
        name=args.name,
        kind=kind,
        num_kv_blocks=kv_blocks_from_args(args, loaded, default_kv_blocks),
        block_size=args.block_size,
        scheduler=SchedulerConfig(max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                                  max_waiting=args.max_waiting),
        prefix_caching=args.prefix_caching == "on",
        cpu_kernel_variant=_cpu_kernel_variant(device),
    )
    device_lock = threading.Lock()
    # A host pool lives in a shared segment, so that engines on this host write imports straight into it.
    kv_memory = SharedKvMemory() if args.kv_transport == "auto" and device.startswith("cpu") else None
    if make_runner is not None:
        runner = make_runner(loaded, config, kv_memory)
    else:
        num_blocks, num_window_blocks = kv_pool_sizes(loaded.config, config)
        runner = ModelRunner(loaded, num_blocks, config.block_size, kv_memory=kv_memory,
                             num_window_blocks=num_window_blocks)
    loop = EngineLoop(EngineCore(loaded, config, runner), step_lock=device_lock,
                      metrics=PrometheusLoopMetrics(config.name))
    return EngineDaemonParts(loaded, loop, device_lock, kv_memory)


def _cpu_kernel_variant(device: str) -> str:
    """The CPU kernels' variant this engine computes with (logged once by cpu_kernels), or "n/a"."""
    if not device.startswith("cpu"):
        return "n/a"
    from dualpace.model.cpu_kernels import kernel_info

    return kernel_info()["variant"]


def warm_up(core: EngineCore) -> None:
    """Run one short request through the engine before serving: the first forward pass pays
    for lazy initialisation (kernels, allocator) here rather than in a client's TTFT, and a
    broken model fails before READY=1. Raises ModelLoadError if KV blocks are not all back.
    The warm-up prompt's cached blocks are dropped: no client sent it."""
    core.runner.prepare_guided_decoding()  # structured outputs' vocabulary, built in the background
    blocks = core.scheduler.blocks
    vocab_size = core.loaded.config.vocab_size
    prompt = [(i + 1) % vocab_size for i in range(WARMUP_PROMPT_TOKENS)]
    core.add_request(WARMUP_REQUEST_ID, prompt, SamplingParams(max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True))
    for _ in range(4 * (WARMUP_PROMPT_TOKENS + WARMUP_MAX_TOKENS)):  # bounded: a scheduler bug must not hang start-up
        if not core.has_work:
            break
        core.step()
    if core.has_work or core.scheduler.requests:
        raise ModelLoadError("warm-up request did not finish")
    for pool in core.scheduler.pools:  # a model mixing sliding and global layers has two
        if pool.num_used_blocks != 0:
            raise ModelLoadError(f"warm-up left {pool.num_used_blocks} KV blocks allocated")
    blocks.clear_cache()
    if core.scheduler.prefix_cache is not None:
        core.scheduler.prefix_cache.reset_counts()
    core.num_steps = 0  # the load report counts served steps only


def run_engine_daemon(
    args: argparse.Namespace,
    process_name: str,
    build: Callable[[], EngineDaemonParts],
    extra_services: Callable[[EngineDaemonParts, grpc.aio.Server], list[str]] | None = None,
) -> int:
    """Load, warm up, serve until stopped, drain; return the exit status (2 bad start, 1 engine failed)."""
    try:
        configure_logging(args.log_level)
    except DualPaceError as exc:
        print(f"{process_name}: error: {exc}", file=sys.stderr)
        return 2
    notifier = Notifier.from_environ()
    try:
        faults = FaultConfig.from_args(args)
        security = security_from_args(args)
        check_listen_security(args.listen, security.tls)  # before the slow model load
        peers = PeerList(args.peer)
        if args.grace_s < 0:
            raise InvalidArgument("--grace-s", f"must be >= 0, got {args.grace_s}")
        if not args.orphan_timeout_s > 0:
            raise InvalidArgument("--orphan-timeout-s", f"must be > 0, got {args.orphan_timeout_s}")
        start_from_args(args, process_name)  # before the slow load: a busy port fails at once
        timeline = StepTimeline(args.step_timeline) if args.step_timeline else None  # a bad path fails here
        notifier.status(f"loading model {args.model}")
        parts = build()
        parts.loop.step_timeline = timeline  # EngineLoop._step appends a record per step
        notifier.status("warming up")
        warm_up(parts.loop.core)
    except DualPaceError as exc:
        print(f"{process_name}: error: {exc}", file=sys.stderr)
        return 2  # a refusal is its one line on stderr, nothing else
    get_logger(__name__).info("effective configuration", daemon=process_name, config=effective_config(args))
    if faults.any:
        log.warning("fault injection enabled: %s", faults)
    # Faults are honoured from here on, so the warm-up steps are not counted (FORWARD_RAISE_AT_STEP).
    parts.loop.step_delay_s = faults.step_delay_s
    parts.loop.core.runner.set_faults(faults)
    parts.loop.update_metrics()  # the KV pool size is known before the first request
    interval_s = watchdog_interval_s()
    if interval_s is not None and notifier.enabled:
        log.info("systemd watchdog: pinging from the step loop every %.1f s", interval_s)
        parts.loop.set_alive_callback(notifier.watchdog, interval_s)

    async def main(stop: asyncio.Event) -> int:
        service_names = [ENGINE_SERVICE]
        channels = PeerChannels()  # to the peers this daemon sends KV to, kept open across transfers
        parts.peer_tls, parts.channels = security.tls, channels
        # The KV data socket to engines on other hosts (over TLS where this daemon serves TLS).
        tls = security.tls.data_server_context() if security.tls is not None else None
        tcp = await TcpDataServer.start(data_socket_host(args.listen), tls)
        parts.data_socket = tcp
        same_host = SameHostKv(args.kv_transport, await SharedKvPool.start(parts.kv_memory), channels=channels,
                               tcp=tcp)

        def register(server: grpc.aio.Server) -> None:
            servicer = EngineServicer(parts.loop, faults, auth_token=security.auth_token,
                                      orphan_timeout_s=args.orphan_timeout_s, same_host=same_host, peers=peers,
                                      tls=security.tls, channels=channels)
            engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
            if extra_services is not None:
                service_names.extend(extra_services(parts, server))

        loop_task = asyncio.create_task(parts.loop.run())
        try:
            running = await start_server(args.listen, register, service_names, security=security)
        except DualPaceError as exc:
            print(f"{process_name}: error: {exc}", file=sys.stderr)
            parts.loop.stop()
            await loop_task
            return 2
        print_listening(process_name, running.address)
        notifier.ready(f"serving on {running.address}")
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, loop_task], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        parts.loop.start_draining()  # before health says NOT_SERVING: whoever sees that gets UNAVAILABLE
        notifier.stopping(f"draining {parts.loop.num_requests} requests (grace {args.grace_s:g} s)")
        await running.set_serving(False)
        await drain(parts.loop, args.grace_s)
        parts.loop.stop()
        await loop_task
        await running.stop(grace_s=FLUSH_GRACE_S)
        await channels.close()  # after the server stopped: no MigrateOut or CopyPrefix is left on them
        await same_host.close()
        parts.loop.close()
        if timeline is not None:
            timeline.close()  # the last records reach the file before exit
        notifier.close()
        if parts.loop.fatal_error is not None:
            print(f"{process_name}: engine failed: {parts.loop.fatal_error}", file=sys.stderr)
            return 1
        return 0

    return serve_forever(main)


async def drain(loop: EngineLoop, grace_s: float) -> None:
    """Refuse new work; let running requests finish within grace_s, then abort the rest."""
    loop.start_draining()
    if loop.stopped.is_set():
        return
    log.info("draining: %d requests, grace %.1f s", loop.num_requests, grace_s)
    if await loop.wait_drained(grace_s):
        log.info("drained")
        return
    try:
        num_aborted = await loop.abort_all()
    except DualPaceError:  # the engine failed meanwhile; its streams already ended with the error
        return
    log.warning("grace of %.1f s is over: aborted %d requests", grace_s, num_aborted)
