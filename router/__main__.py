"""`dualpace-router` / `python -m router`: serve the Router API, or show live placement.

    dualpace-router serve --gpu ADDR --cpu ADDR [--policy dualpace|gated|gpu-only] ...
    dualpace-router placement --router ADDR [--watch] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dualpace.errors import DualPaceError, InvalidArgument
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.serve.loop import serve_forever
from dualpace.serve.server import print_listening, start_server
from dualpace.wire.v1 import router_pb2_grpc
from router.admission import AdmissionConfig
from router.core import RouterConfig, RouterCore
from router.engines import EngineHandle, EnginePool
from router.migration_planner import MigrationConfig
from router.service import RouterServicer
from router.views import Policy

ROUTER_SERVICE = "dualpace.v1.Router"
ENGINE_READY_TIMEOUT_S = 60.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", help="gpu_service address HOST:PORT")
    parser.add_argument("--cpu", help="cpu_service address HOST:PORT (absent: GPU engine only)")
    parser.add_argument("--policy", default="dualpace", choices=[p.value for p in Policy])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="the engines' model (for its tokenizer)")
    parser.add_argument("--profile", default=None, help="hardware profile JSON (not implemented yet)")
    parser.add_argument("--itl-target-ms", type=float, default=None, help="engines above it take no new requests")
    parser.add_argument("--ttft-target-ms", type=float, default=None,
                        help="how long a request may wait for room (default 30 s)")
    parser.add_argument("--no-migrate", action="store_true", help="no load-driven migrations (hand-offs still run)")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--log-level", default="INFO")


def router_config(args: argparse.Namespace, kv_bytes_per_token: int) -> RouterConfig:
    if args.profile is not None:
        raise InvalidArgument("--profile", "profiles are not implemented yet; admission uses capacity rules")
    if args.gpu is None and args.cpu is None:
        raise InvalidArgument("--gpu", "give at least one engine address (--gpu and/or --cpu)")
    policy = Policy(args.policy)
    if policy == Policy.GPU_ONLY and args.gpu is None:
        raise InvalidArgument("--gpu", "policy gpu-only needs --gpu")
    for name in ("itl_target_ms", "ttft_target_ms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise InvalidArgument(f"--{name.replace('_', '-')}", f"must be positive, got {value}")
    return RouterConfig(
        policy=policy,
        admission=AdmissionConfig(policy=policy, itl_target_ms=args.itl_target_ms),
        migration=MigrationConfig(kv_bytes_per_token=kv_bytes_per_token),
        queue_timeout_s=args.ttft_target_ms / 1e3 if args.ttft_target_ms else 30.0,
        migrate_enabled=not args.no_migrate,
    )


def serve(args: argparse.Namespace) -> int:
    from dualpace.model.loader import load_tokenizer_and_config

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer, model_config = load_tokenizer_and_config(args.model)
        kv_bytes_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 2
        config = router_config(args, kv_bytes_per_token)
    except DualPaceError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2

    async def main(stop: asyncio.Event) -> int:
        handles = [EngineHandle(args.gpu, "gpu")] if args.gpu else []
        if args.cpu and config.policy != Policy.GPU_ONLY:
            handles.append(EngineHandle(args.cpu, "cpu"))
        core = RouterCore(EnginePool(handles), tokenizer, model_config, config)
        core.start()
        if not await core.pool.wait_ready(ENGINE_READY_TIMEOUT_S):
            logging.getLogger(__name__).warning("not every engine answered within %.0f s; serving anyway",
                                                ENGINE_READY_TIMEOUT_S)
        try:
            running = await start_server(
                args.listen, lambda server: router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), server),
                [ROUTER_SERVICE])
        except DualPaceError as exc:
            print(f"router: error: {exc}", file=sys.stderr)
            await core.close()
            return 2
        print_listening("router", running.address)
        await stop.wait()
        await running.set_serving(False)
        await running.stop(grace_s=5.0)
        await core.close()
        return 0

    return serve_forever(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dualpace-router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="serve the Router API"))
    placement = commands.add_parser("placement", help="show engines and where each request runs")
    placement.add_argument("--router", required=True, help="router address HOST:PORT")
    placement.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    placement.add_argument("--json", action="store_true", help="print one JSON object")
    placement.add_argument("--interval-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    from router.placement_cli import run_placement

    return run_placement(args)


if __name__ == "__main__":
    sys.exit(main())
