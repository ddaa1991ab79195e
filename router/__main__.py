"""`dualpace-router` / `python -m router`: serve the Router API, or show live placement.

    dualpace-router serve --gpu ADDR --cpu ADDR [--policy dualpace|gated|gpu-only] [--http-listen HOST:PORT] ...
    dualpace-router placement --router ADDR [--watch] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import replace

from dualpace.errors import DualPaceError, InvalidArgument
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.profile.data_paths import KV_TRANSPORT_SETTINGS
from dualpace.serve.config import (
    add_config_argument,
    effective_config,
    parse_with_config,
)
from dualpace.serve.logging_setup import configure_logging, get_logger
from dualpace.serve.event_loop import serve_forever
from dualpace.serve.metrics import add_metrics_argument, start_from_args
from dualpace.serve.sd_notify import Notifier, watchdog_interval_s
from dualpace.serve.security import (
    add_security_arguments,
    check_listen_security,
    security_from_args,
)
from dualpace.serve.server import print_listening, start_server
from dualpace.wire.v1 import router_pb2_grpc
from dualpace.policy.admission import AdmissionConfig, GpuAdmission
from router.router_core import RouterConfig, RouterCore
from router.engines import EngineHandle, EnginePool
from dualpace.policy.host_tier import HostTierRule
from dualpace.policy.migration_planner import MigrationConfig
from router.prompt_work import PromptLimits, add_prompt_arguments
from router.service import RouterServicer
from dualpace.policy.policies import POLICY_NAMES, Policy, policy_help, traits

ROUTER_SERVICE = "dualpace.v1.Router"
ENGINE_READY_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 30.0
FLUSH_GRACE_S = 5.0  # after the drain: time for the last stream messages (and statuses) to leave

log = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", help="gpu_service address HOST:PORT")
    parser.add_argument("--cpu", help="cpu_service address HOST:PORT (absent: GPU engine only)")
    parser.add_argument("--policy", default=Policy.DUALPACE.value, choices=POLICY_NAMES, help=policy_help())
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="the engines' model (for its tokenizer)")
    parser.add_argument("--profile", default=None,
                        help="hardware profile JSON (`dualpace profile`): admission and migration use its cost model")
    parser.add_argument("--profile-ignore-fingerprint", action="store_true",
                        help="use --profile even if it was made for another model")
    parser.add_argument("--itl-target-ms", type=float, default=None,
                        help="engines above it take no new requests (with --profile: their predicted ITL with "
                             "one more request; without: their measured p50 ITL)")
    parser.add_argument("--gpu-admission", choices=[m.value for m in GpuAdmission], default=None,
                        help="how gpu_service's KV room is counted: optimistic (the KV allocated now plus a 1%% "
                             "watermark; gpu_service preempts by recompute, as vLLM V1) or reserve (every placed "
                             "request at prompt + max_tokens; never preempts). Default: optimistic for gpu-only, "
                             "reserve for dualpace and gated (the CPU engine takes the overflow)")
    parser.add_argument("--ttft-target-ms", type=float, default=None,
                        help="how long a request may wait for room (default 30 s)")
    parser.add_argument("--no-migrate", action="store_true", help="no load-driven migrations (hand-offs still run)")
    parser.add_argument("--resume-wait-s", type=float, default=RouterConfig.resume_wait_s,
                        help="when an engine dies holding a request no other engine can ever hold (its pool is too "
                             "small, or it refuses the continuation), how long the request waits, paused, for that "
                             "engine to come back on its address and continues there; then UNAVAILABLE. The "
                             "default covers `dualpace up`'s and the systemd units' restart back-off")
    parser.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORT_SETTINGS,
                        help="the engines' --kv-transport, for pricing moves with --profile: auto prices them at "
                             "the profile's shared-memory figures when both engines are on this host (Unix socket "
                             "or loopback addresses), else (and with tcp) at its TCP data-socket figures (its gRPC "
                             "figures where it has none)")
    parser.add_argument("--host-tier", default="on", choices=["on", "off"],
                        help="dualpace: continue a request on the CPU engine when it caches (e.g. in the GPU "
                             "engine's host tier) a longer prefix of the prompt than any GPU engine")
    parser.add_argument("--host-tier-min-gain-tokens", type=int, default=HostTierRule.min_gain_tokens,
                        help="cached on the CPU engine beyond the best GPU engine, for it to take the request")
    parser.add_argument("--host-tier-max-suffix-tokens", type=int, default=HostTierRule.max_suffix_tokens,
                        help="the most prompt tokens past its cached prefix the CPU engine prefills itself")
    parser.add_argument("--host-tier-copy-back", default="on", choices=["on", "off"],
                        help="dualpace: copy a prefix only the CPU engine caches back to the GPU engine when "
                             "the cost rule prefers that (or the suffix is too long to prefill on the CPU)")
    parser.add_argument("--listen", default="127.0.0.1:0",
                        help="HOST:PORT, or unix:PATH (a socket only this user can reach); a non-loopback host "
                             "needs --tls-cert/--tls-key")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="on SIGTERM, how long relayed streams may take to finish before they are cancelled")
    parser.add_argument("--http-listen", default=None, metavar="HOST:PORT",
                        help="also serve the OpenAI-compatible HTTP API here (absent: no HTTP); same TLS and token rules")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (JSON lines on stderr)")
    add_prompt_arguments(parser)
    add_config_argument(parser)
    add_metrics_argument(parser)
    add_security_arguments(parser)
    parser.add_argument("--engine-tls", default="off", choices=["off", "on"],
                        help="on: reach TCP engines over TLS (engines that serve --tls-cert), presenting this "
                             "router's certificate and checking theirs against --tls-client-ca; unix: engines "
                             "stay plaintext. Needs --tls-cert/--tls-key")


def _gpu_admission(args: argparse.Namespace) -> GpuAdmission | None:
    value = getattr(args, "gpu_admission", None)
    if value is None:
        return None
    try:
        return GpuAdmission(value)
    except ValueError:
        raise InvalidArgument("--gpu-admission", f"expected one of {', '.join(m.value for m in GpuAdmission)}, "
                              f"got {value!r}") from None


def router_config(args: argparse.Namespace, kv_bytes_per_token: int, profile=None) -> RouterConfig:
    """The router's policy configuration; `profile` (already checked against the model) makes
    admission and migration use its cost model."""
    if args.gpu is None and args.cpu is None:
        raise InvalidArgument("--gpu", "give at least one engine address (--gpu and/or --cpu)")
    policy = Policy(args.policy)
    if not traits(policy).uses_cpu_engine and args.gpu is None:
        raise InvalidArgument("--gpu", f"policy {policy.value} needs --gpu")
    for name in ("itl_target_ms", "ttft_target_ms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise InvalidArgument(f"--{name.replace('_', '-')}", f"must be positive, got {value}")
    resume_wait_s = getattr(args, "resume_wait_s", RouterConfig.resume_wait_s)
    if not resume_wait_s >= 0:
        raise InvalidArgument("--resume-wait-s", f"must be >= 0, got {resume_wait_s}")
    predictor = None
    if profile is not None:
        from dualpace.profile.cost_model import CostModel
        from dualpace.profile.data_paths import assist_path, for_paths, kv_path, on_this_host

        # The figures of the paths in force: hand-offs and moves between the two engines, and the
        # CPU engine's Dense Assist from gpu_service (its default --assist-transport, auto).
        same_host = all(on_this_host(address) for address in (args.gpu, args.cpu) if address is not None)
        profile = for_paths(profile, kv=kv_path(getattr(args, "kv_transport", "auto"), same_host),
                            assist=assist_path("auto", same_host))

        # Assisted CPU iterations need both engines; the cost model then predicts the faster mode.
        predictor = CostModel(profile, assist_available=args.gpu is not None and traits(policy).uses_cpu_engine)
    return RouterConfig(
        policy=policy,
        admission=AdmissionConfig(policy=policy, itl_target_ms=args.itl_target_ms, predictor=predictor,
                                  gpu_admission=_gpu_admission(args)),
        migration=MigrationConfig(kv_bytes_per_token=kv_bytes_per_token, predictor=predictor,
                                  cpu_itl_target_ms=args.itl_target_ms if predictor is not None else None),
        queue_timeout_s=args.ttft_target_ms / 1e3 if args.ttft_target_ms else 30.0,
        migrate_enabled=not args.no_migrate,
        resume_wait_s=resume_wait_s,
        host_tier=_host_tier_rule(args),
    )


def _host_tier_rule(args: argparse.Namespace) -> HostTierRule:
    for flag in ("host_tier_min_gain_tokens", "host_tier_max_suffix_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise InvalidArgument(f"--{flag.replace('_', '-')}", f"must be >= 1, got {value}")
    return HostTierRule(enabled=getattr(args, "host_tier", "on") == "on",
                        min_gain_tokens=getattr(args, "host_tier_min_gain_tokens", None) or HostTierRule.min_gain_tokens,
                        max_suffix_tokens=getattr(args, "host_tier_max_suffix_tokens", None)
                        or HostTierRule.max_suffix_tokens,
                        copy_back=getattr(args, "host_tier_copy_back", "on") == "on")


def serve(args: argparse.Namespace) -> int:
    from dualpace.model.loader import load_tokenizer_and_config

    try:
        configure_logging(args.log_level)
    except DualPaceError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    notifier = Notifier.from_environ()
    try:
        security = security_from_args(args)
        check_listen_security(args.listen, security.tls)
        if args.http_listen is not None:
            check_listen_security(args.http_listen, security.tls, "--http-listen", allow_unix=False)
        if args.engine_tls == "on" and security.tls is None:
            raise InvalidArgument("--engine-tls", "on needs --tls-cert and --tls-key (the router's client certificate)")
        engine_tls = security.tls if args.engine_tls == "on" else None
        if args.grace_s < 0:
            raise InvalidArgument("--grace-s", f"must be >= 0, got {args.grace_s}")
        notifier.status(f"loading the tokenizer of {args.model}")
        tokenizer, model_config = load_tokenizer_and_config(args.model)
        kv_bytes_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 2
        profile = None
        if args.profile is not None:
            from dualpace.profile.daemon import load_daemon_profile

            profile = load_daemon_profile(args.profile, model_config,
                                          ignore_fingerprint=args.profile_ignore_fingerprint)
            kv_bytes_per_token = profile.model.kv_bytes_per_token  # the engines' KV dtype, as profiled
        config = replace(router_config(args, kv_bytes_per_token, profile),
                         prompt_limits=PromptLimits(args.max_prompt_chars, args.prompt_workers,
                                                    args.max_request_bytes))
        start_from_args(args, "router")
    except DualPaceError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    get_logger(__name__).info("effective configuration", daemon="router", config=effective_config(args))
    if args.profile is not None:
        get_logger(__name__).info(
            "profile loaded", profile=args.profile,
            admission="predicted ITL with one more request vs --itl-target-ms" if args.itl_target_ms
            else "capacity rules (give --itl-target-ms to admit by predicted ITL)",
            migration="payoff from predicted ITLs and KV transfer time")

    async def main(stop: asyncio.Event) -> int:
        token = security.auth_token  # the engines require the same shared token
        handles = [EngineHandle(args.gpu, "gpu", token, engine_tls)] if args.gpu else []
        if args.cpu and traits(config.policy).uses_cpu_engine:
            handles.append(EngineHandle(args.cpu, "cpu", token, engine_tls))
        notifier.status("waiting for the engines")
        core = RouterCore(EnginePool(handles), tokenizer, model_config, config)
        core.start()
        if not await core.pool.wait_ready(ENGINE_READY_TIMEOUT_S):
            logging.getLogger(__name__).warning("not every engine answered within %.0f s; serving anyway",
                                                ENGINE_READY_TIMEOUT_S)
        servicer = RouterServicer(core)
        try:
            running = await start_server(
                args.listen, lambda server: router_pb2_grpc.add_RouterServicer_to_server(servicer, server),
                [ROUTER_SERVICE], security=security, max_receive_bytes=config.prompt_limits.receive_bytes)
        except DualPaceError as exc:
            print(f"router: error: {exc}", file=sys.stderr)
            await core.close()
            return 2
        http = None
        if args.http_listen is not None:
            from router.http_api import HttpFront, start_http

            try:
                http = await start_http(HttpFront(core, args.model, security.auth_token), args.http_listen,
                                        args.tls_cert, args.tls_key, args.tls_client_ca, grace_s=args.grace_s)
            except DualPaceError as exc:
                print(f"router: error: {exc}", file=sys.stderr)
                await running.stop(grace_s=0)
                await core.close()
                return 2
        print_listening("router", running.address)  # first: launchers take the first address as gRPC's
        if http is not None:
            print_listening("router http", http.address)
        notifier.ready(f"serving on {running.address}")
        watchdog = start_watchdog(notifier)
        await stop.wait()
        # The gRPC server keeps running while the streams drain: health answers NOT_SERVING and
        # new Generate calls UNAVAILABLE (server.stop() would refuse every call, health checks
        # included, from its first moment). Draining first: whoever sees NOT_SERVING gets UNAVAILABLE.
        servicer.drain.start_draining()
        notifier.stopping(f"finishing {servicer.drain.num_streams} relayed streams (grace {args.grace_s:g} s)")
        await running.set_serving(False)
        drained, *_ = await asyncio.gather(drain(servicer, args.grace_s),
                                           *([http.stop()] if http is not None else []))
        # Time for the last messages and statuses to leave (any stream still running is cancelled).
        await running.stop(grace_s=FLUSH_GRACE_S if drained else 0)
        if watchdog is not None:
            watchdog.cancel()
        await core.close()
        notifier.close()
        return 0

    return serve_forever(main)


async def drain(servicer: RouterServicer, grace_s: float) -> bool:
    """Lets the relayed Generate streams finish within grace_s, then ends the rest with
    UNAVAILABLE (their engine requests aborted); whether every stream has ended."""
    log.info("draining: %d relayed streams, grace %.1f s", servicer.drain.num_streams, grace_s)
    if await servicer.drain.wait_drained(grace_s):
        log.info("drained")
        return True
    num_cancelled = servicer.drain.cancel_streams(f"router is shutting down and its grace of {grace_s:g} s is over")
    log.warning("grace of %.1f s is over: cancelling %d relayed streams", grace_s, num_cancelled)
    return await servicer.drain.wait_drained(FLUSH_GRACE_S)


def start_watchdog(notifier: Notifier) -> asyncio.Task | None:
    """A task sending WATCHDOG=1 every half WatchdogSec while the event loop runs (None: no watchdog)."""
    interval_s = watchdog_interval_s()
    if interval_s is None or not notifier.enabled:
        return None

    async def ping() -> None:
        while True:
            notifier.watchdog()
            await asyncio.sleep(interval_s)

    return asyncio.create_task(ping())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dualpace-router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve the Router API")
    add_serve_arguments(serve_parser)
    placement = commands.add_parser("placement", help="show engines and where each request runs")
    placement.add_argument("--router", required=True, help="router address HOST:PORT")
    placement.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    placement.add_argument("--json", action="store_true", help="print one JSON object")
    placement.add_argument("--interval-s", type=float, default=1.0)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        # flags after `serve`, with DUALPACE_<FLAG> and --config filling what they leave unset
        serve_args = parse_with_config(serve_parser, argv[argv.index("serve") + 1:])
        serve_args.command = "serve"
        return serve(serve_args)
    from router.placement_cli import run_placement

    return run_placement(args)


if __name__ == "__main__":
    sys.exit(main())
