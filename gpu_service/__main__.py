"""`dualpace-gpu` / `python -m gpu_service`: the GPU engine daemon.

Runs prefills and GPU-resident decodes with its own scheduler, device KV cache
and step loop (dualpace.v1.Engine), and serves Dense Assist to the CPU engine
(dualpace.v1.DenseAssist), sharing one device lock: an assist stage takes it per layer's
dense work, and the engine's forward hands it over between its own layers
(DeviceHandoff; see gpu_service/dense_assist.py). With --assist-join on (the default) a
same-host CPU engine's iterations may instead join this engine's steps through a JoinDesk.
On a machine without CUDA the same code runs on the CPU device.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc

from dualpace.engine.gate import DeviceHandoff
from dualpace.engine.assist.join_desk import JoinDesk
from dualpace.engine.assist.joined_step import JoinSettings
from dualpace.engine.core import kv_pool_sizes
from dualpace.engine.runner import ModelRunner
from dualpace.errors import InvalidArgument
from dualpace.model.loader import resolve_device
from dualpace.serve.config import parse_with_config
from dualpace.serve.engine_daemon import (
    EngineDaemonParts,
    add_engine_arguments,
    build_engine,
    run_engine_daemon,
)
from gpu_service.assist_limits import AssistLimits, add_assist_limit_arguments, limits_from_args
from gpu_service.assist_servicer import add_dense_assist_servicer
from gpu_service.dense_assist import DenseAssistExecutor

log = logging.getLogger(__name__)

DEFAULT_KV_BLOCKS = 256  # a small pool: GPU memory is the scarce resource this system works around
DENSE_ASSIST_SERVICE = "dualpace.v1.DenseAssist"
_background: set[asyncio.Task] = set()  # strong references to the host tier's task


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dualpace-gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser, default_name="gpu", default_kv_blocks=DEFAULT_KV_BLOCKS)
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    add_assist_limit_arguments(parser)
    parser.add_argument("--host-tier", default=None, metavar="ADDRESS",
                        help="the CPU engine (cpu_service) whose pool is this engine's host tier: the prefix-cache "
                             "blocks of each finished request are offered to it, so they outlive their eviction "
                             "here (needs --prefix-caching on; default: none)")
    parser.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                        help="on CUDA with the paged Triton attention: capture decode steps of up to --max-running "
                             "sequences as CUDA graphs at start-up, one per batch-size bucket, and replay them "
                             "(prefill and larger steps run eagerly); no effect on a CPU (default: on)")
    return parse_with_config(parser, argv)


def decode_graph_batch(args: argparse.Namespace, device: str) -> int:
    """The largest decode batch replayed as a CUDA graph, or 0 for none (off, not CUDA, or no paged kernel)."""
    import torch

    from dualpace.model.attention_backend import KernelChoices, uses_triton

    if args.cuda_graphs != "on" or not device.startswith("cuda"):
        return 0
    choices = KernelChoices(args.attention_backend, args.fused_kernels)
    return args.max_running if uses_triton(torch.device(device), choices) else 0


def start_host_tier(args: argparse.Namespace, parts: EngineDaemonParts) -> None:
    """Offer finished requests' cached blocks to --host-tier (dualpace.engine.transfer.host_tier), in the background."""
    from dualpace.engine.transfer.host_tier import HostTierOffers
    from dualpace.serve import metrics
    from dualpace.serve.kv_tcp_transport import TcpKvSender
    from dualpace.serve.security import read_token_file

    # as the daemon's migrations: the KV over the target's data socket (TLS when this daemon serves
    # TLS), the control messages on the channel it keeps to that peer
    sender = TcpKvSender(args.host_tier, auth_token=read_token_file(args.auth_token_file), tls=parts.peer_tls,
                         channels=parts.channels)
    offers = HostTierOffers(parts.loop, sender.send_cache)
    _background.add(asyncio.get_running_loop().create_task(offers.run()))
    counts, name = offers.counts, parts.loop.core.config.name
    metrics.register_callback_gauges(metrics.CallbackGauges(
        "dualpace_host_tier_offers", "Host-tier offers since start, by outcome (accepted, failed, dropped, skipped).",
        ("engine", "outcome"), lambda: {(name, outcome): float(getattr(counts, f"num_{attr}")) for outcome, attr in
                                        (("accepted", "offers"), ("failed", "failed"), ("dropped", "dropped"),
                                         ("skipped", "skipped"))}))
    metrics.register_callback_gauges(metrics.CallbackGauges(
        "dualpace_host_tier_offered_blocks", "KV blocks the host tier accepted from this engine since start.",
        ("engine",), lambda: {(name,): float(counts.num_offered_blocks)}))


def attach_join_desk(parts: EngineDaemonParts, limits: AssistLimits) -> None:
    """Same-host CPU iterations may ride in this engine's steps (remote rows; shared memory only).
    Before the engine loop runs: it subscribes to the desk's offers when it starts."""
    if limits.join_enabled and limits.shm_enabled:
        desk = JoinDesk(parts.loaded.config.num_layers)
        parts.loop.core.runner.set_join_desk(desk, JoinSettings(min_layer_wait_ms=limits.join_min_layer_wait_ms))


def assist_services(args: argparse.Namespace, limits: AssistLimits):
    if args.host_tier is not None and args.prefix_caching != "on":
        raise InvalidArgument("--host-tier", "needs --prefix-caching on")

    def add_assist(parts: EngineDaemonParts, server: grpc.aio.Server) -> list[str]:
        if args.host_tier is not None and not parts.loop.core.moves_kv:
            # `dualpace up` passes --host-tier by default: the engine serves, without offers
            log.warning("--host-tier off: this model's sliding layers hold a KV pool of their own, which no KV "
                        "transfer carries (EngineCore.moves_kv)")
        elif args.host_tier is not None:
            start_host_tier(args, parts)
        runner = parts.loop.core.runner
        handoff = DeviceHandoff(parts.device_lock, runner.finish_device_work)
        # the engine's forward offers the device to waiting assist stages between its layers
        runner.forward.between_layers = handoff.yield_to_waiting
        executor = DenseAssistExecutor(parts.loaded.model, handoff, parts.loop.gate, limits.stage_timeout_s,
                                       runner.desk)
        add_dense_assist_servicer(executor, server, limits, parts.data_socket)
        return [DENSE_ASSIST_SERVICE]

    return add_assist


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        limits = limits_from_args(args)  # checked before the model loads: a bad value refuses to start
        add_assist = assist_services(args, limits)
    except InvalidArgument as exc:
        print(f"gpu_service: error: {exc}", file=sys.stderr)
        return 2

    def build() -> EngineDaemonParts:
        device = str(resolve_device(args.device))
        graph_batch = decode_graph_batch(args, device)

        def make_runner(loaded, config, kv_memory) -> ModelRunner:
            num_blocks, num_window_blocks = kv_pool_sizes(loaded.config, config)
            return ModelRunner(loaded, num_blocks, config.block_size, kv_memory=kv_memory,
                               decode_graph_batch=graph_batch, num_window_blocks=num_window_blocks)

        parts = build_engine(args, kind="gpu", device=device, default_kv_blocks=DEFAULT_KV_BLOCKS,
                             make_runner=make_runner)
        parts.loop.core.runner.capture_decode_graphs()  # before the warm-up request and serving
        attach_join_desk(parts, limits)
        return parts

    return run_engine_daemon(args, "gpu_service", build, add_assist)


if __name__ == "__main__":
    sys.exit(main())
