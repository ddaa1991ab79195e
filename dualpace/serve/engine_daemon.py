"""What gpu_service and cpu_service share as daemons: flags, building the engine,
serving dualpace.v1.Engine (plus any extra services) until SIGINT/SIGTERM, and
leaving with a non-zero status if the engine's forward pass failed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.engine.runner import ModelRunner
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.errors import DualPaceError, InvalidArgument
from dualpace.faults import FaultConfig
from dualpace.model.loader import LoadedModel
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.serve.engine_servicer import EngineServicer
from dualpace.serve.loop import serve_forever
from dualpace.serve.server import print_listening, start_server
from dualpace.wire.v1 import engine_pb2_grpc

log = logging.getLogger(__name__)
ENGINE_SERVICE = "dualpace.v1.Engine"
STOP_GRACE_S = 5.0


def add_engine_arguments(parser: argparse.ArgumentParser, default_name: str, default_kv_blocks: int) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="known name, Hugging Face folder or .gguf file")
    parser.add_argument("--name", default=default_name, help="engine name shown to the router and in logs")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, help=f"KV pool size in blocks (default {default_kv_blocks})")
    kv.add_argument("--kv-gb", type=float, help="KV pool size in GB (instead of --kv-blocks)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (decodes + prefill chunks)")
    parser.add_argument("--max-running", type=int, default=64, help="sequences per step")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before RESOURCE_EXHAUSTED")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT; port 0 picks a free port")
    parser.add_argument("--log-level", default="INFO")


@dataclass
class EngineDaemonParts:
    loaded: LoadedModel
    loop: EngineLoop
    device_lock: threading.Lock


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
    loaded = load_model(args.model, dtype=args.dtype, device=device)
    config = EngineConfig(
        name=args.name,
        kind=kind,
        num_kv_blocks=kv_blocks_from_args(args, loaded, default_kv_blocks),
        block_size=args.block_size,
        scheduler=SchedulerConfig(max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                                  max_waiting=args.max_waiting),
    )
    device_lock = threading.Lock()
    runner = make_runner(loaded, config) if make_runner is not None else None
    loop = EngineLoop(EngineCore(loaded, config, runner), step_lock=device_lock)
    return EngineDaemonParts(loaded, loop, device_lock)


def run_engine_daemon(
    args: argparse.Namespace,
    process_name: str,
    build: Callable[[], EngineDaemonParts],
    extra_services: Callable[[EngineDaemonParts, grpc.aio.Server], list[str]] | None = None,
) -> int:
    """Load, serve until stopped, and return the process exit status (1 if the engine failed)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        faults = FaultConfig.from_environ()
        parts = build()
    except DualPaceError as exc:
        print(f"{process_name}: error: {exc}", file=sys.stderr)
        return 2
    if faults.any:
        log.warning("fault injection enabled: %s", faults)

    async def main(stop: asyncio.Event) -> int:
        service_names = [ENGINE_SERVICE]

        def register(server: grpc.aio.Server) -> None:
            engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(parts.loop, faults), server)
            if extra_services is not None:
                service_names.extend(extra_services(parts, server))

        loop_task = asyncio.create_task(parts.loop.run())
        try:
            running = await start_server(args.listen, register, service_names)
        except DualPaceError as exc:
            print(f"{process_name}: error: {exc}", file=sys.stderr)
            parts.loop.stop()
            await loop_task
            return 2
        print_listening(process_name, running.address)
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, loop_task], return_when=asyncio.FIRST_COMPLETED)
        await running.set_serving(False)
        parts.loop.stop()
        await running.stop(grace_s=STOP_GRACE_S)
        await loop_task
        stopped.cancel()
        parts.loop.close()
        if parts.loop.fatal_error is not None:
            print(f"{process_name}: engine failed: {parts.loop.fatal_error}", file=sys.stderr)
            return 1
        return 0

    return serve_forever(main)
