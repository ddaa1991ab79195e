"""`dualpace-cpu` / `python -m cpu_service`: the CPU decode engine daemon.

An independently scheduled engine: full weights and a large KV pool in host
memory, its own scheduler and step loop, never waiting for the GPU engine. Each
iteration runs Local (all stages here) or Assisted (dense stages on gpu_service
through Dense Assist, attention here beside the KV), chosen per iteration;
a failed assisted iteration is redone locally. Requests arrive by KV import
(handoff after a GPU prefill, or migration) or are prefilled here.

With --profile (a `dualpace profile` JSON for this model), the Local-vs-Assisted choice
starts from the profile's predicted latencies per batch bucket; measured latencies then
take over.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cpu_service.assist_client import AssistClient
from cpu_service.assist_shm import TRANSPORTS, slot_bytes_for
from dualpace.policy.mode_choice import AssistSetting, ModeChooser
from dualpace.policy.policies import CPU_SERVICE_POLICY_NAMES, Policy, policy_help, traits
from cpu_service.runner import CpuRunner
from dualpace.engine.core import EngineConfig, kv_pool_sizes
from dualpace.errors import InvalidArgument
from dualpace.model.loader import LoadedModel
from dualpace.serve.auth import read_token_file
from dualpace.serve.config import parse_with_config
from dualpace.serve.security import load_tls, peer_credentials_for
from dualpace.serve.engine_daemon import (
    EngineDaemonParts,
    add_engine_arguments,
    build_engine,
    run_engine_daemon,
)

log = logging.getLogger(__name__)
DEFAULT_KV_BLOCKS = 4096  # host memory is the plentiful resource


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dualpace-cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser, default_name="cpu", default_kv_blocks=DEFAULT_KV_BLOCKS)
    parser.add_argument("--assist", default="auto", choices=[s.value for s in AssistSetting],
                        help="Dense Assist per iteration: auto (the faster mode, measured), always, never")
    parser.add_argument("--gpu-service", default=None, help="gpu_service address for Dense Assist (HOST:PORT)")
    parser.add_argument("--assist-timeout-s", type=float, default=5.0,
                        help="an assisted iteration slower than this is redone locally")
    parser.add_argument("--assist-transport", default="auto", choices=TRANSPORTS,
                        help="Dense Assist: auto (shared memory when gpu_service is on this host, else its TCP data "
                             "socket) or tcp (the data socket even on one host)")
    parser.add_argument("--policy", default=Policy.DUALPACE.value, choices=CPU_SERVICE_POLICY_NAMES,
                        help=policy_help(CPU_SERVICE_POLICY_NAMES))
    parser.add_argument("--profile", default=None,
                        help="hardware profile JSON (`dualpace profile`): seeds the Local/Assisted choice")
    parser.add_argument("--profile-ignore-fingerprint", action="store_true",
                        help="use --profile even if it was made for another model")
    parser.add_argument("--profile-context-tokens", type=int, default=512,
                        help="mean context assumed when seeding the mode choice from the profile")
    return parse_with_config(parser, argv)


def check_args(args: argparse.Namespace):
    """Validate the flags; returns the checked profile (or None) before the slow model load."""
    if args.profile_context_tokens < 1:
        raise InvalidArgument("--profile-context-tokens", f"must be >= 1, got {args.profile_context_tokens}")
    if args.assist == AssistSetting.ALWAYS.value and args.gpu_service is None:
        raise InvalidArgument("--assist", "always needs --gpu-service")
    if traits(args.policy).cpu_decodes_inside_gpu_steps and args.gpu_service is None:
        raise InvalidArgument("--policy", f"{args.policy} needs --gpu-service (dense work always runs on the GPU)")
    if args.assist_timeout_s <= 0:
        raise InvalidArgument("--assist-timeout-s", f"must be positive, got {args.assist_timeout_s}")
    return None if args.profile is None else load_profile_for(args)


def load_profile_for(args: argparse.Namespace):
    """The --profile file, validated and checked against the model's configuration and dtype."""
    from dualpace.model.loader import load_tokenizer_and_config, resolve_dtype
    from dualpace.profile.daemon import load_daemon_profile

    _, model_config = load_tokenizer_and_config(args.model)
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    from dualpace.model.cpu_kernels import kernel_info

    kernels = kernel_info()
    return load_daemon_profile(args.profile, model_config, dtype, args.block_size, args.profile_ignore_fingerprint,
                               cpu_kernel_variant=kernels["variant"], cpu_amx=kernels["amx"])


def seed_chooser(chooser: ModeChooser, profile, assist_available: bool, max_batch_size: int,
                 context_tokens: int) -> dict:
    """Seed the mode choice with the profile's predicted Local / Assisted latency per batch bucket."""
    from dualpace.profile.cost_model import CostModel, predicted_mode_latencies

    cost = CostModel(profile, assist_available=assist_available)
    predicted = predicted_mode_latencies(cost, max_batch_size, context_tokens, assist_available)
    chooser.seed(predicted)
    return predicted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gated = traits(args.policy).cpu_decodes_inside_gpu_steps
    setting = AssistSetting.ALWAYS if gated else AssistSetting(args.assist)

    profile = None

    def make_runner(loaded: LoadedModel, config: EngineConfig, kv_memory=None) -> CpuRunner:
        client = None
        if args.gpu_service is not None and setting != AssistSetting.NEVER:
            tls = load_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
            cfg = loaded.config  # a slot holds the largest batch's q/k/v in float32 (the widest dtype)
            client = AssistClient(args.gpu_service, iteration_timeout_s=args.assist_timeout_s,
                                  auth_token=read_token_file(args.auth_token_file), transport=args.assist_transport,
                                  shm_slot_bytes=slot_bytes_for(config.scheduler.max_running, cfg.num_heads,
                                                                cfg.num_kv_heads, cfg.head_dim),
                                  credentials=peer_credentials_for(args.gpu_service, tls), data_tls=tls and tls.data_client_context())
        chooser = ModeChooser(setting, assist_configured=client is not None)
        if profile is not None:
            from dualpace.profile.data_paths import assist_path, for_paths, on_this_host

            # The assist figures of the path this engine's iterations take (shm on one host, else
            # the data socket's, else the plain ones: dualpace.profile.data_paths).
            path = assist_path(args.assist_transport, args.gpu_service is not None and on_this_host(args.gpu_service))
            predicted = seed_chooser(chooser, for_paths(profile, assist=path), client is not None,
                                     config.scheduler.max_running,
                                     args.profile_context_tokens)
            log.info("mode choice seeded from profile %s: %s", args.profile,
                     ", ".join(f"{mode.value}@{bucket}={ms:.1f}ms" for (mode, bucket), ms in sorted(
                         predicted.items(), key=lambda kv: (kv[0][1], kv[0][0].value))))
        num_blocks, num_window_blocks = kv_pool_sizes(loaded.config, config)
        return CpuRunner(loaded, num_blocks, config.block_size, chooser, client, gated=gated,
                         engine_name=config.name, kv_memory=kv_memory, num_window_blocks=num_window_blocks)

    def build() -> EngineDaemonParts:
        nonlocal profile
        profile = check_args(args)
        return build_engine(args, kind="cpu", device="cpu", default_kv_blocks=DEFAULT_KV_BLOCKS,
                            make_runner=make_runner)

    return run_engine_daemon(args, "cpu_service", build)


if __name__ == "__main__":
    sys.exit(main())
