"""`dualpace-cpu` / `python -m cpu_service`: the CPU decode engine daemon.

An independently scheduled engine: full weights and a large KV pool in host
memory, its own scheduler and step loop, never waiting for the GPU engine. Each
iteration runs Local (all stages here) or Assisted (dense stages on gpu_service
through Dense Assist, attention here beside the KV), chosen per iteration;
a failed assisted iteration is redone locally. Requests arrive by KV import
(handoff after a GPU prefill, or migration) or are prefilled here.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cpu_service.assist_client import AssistClient
from cpu_service.backend import BACKENDS, select_backend
from cpu_service.mode_choice import AssistSetting, ModeChooser
from cpu_service.runner import CpuRunner
from dualpace.engine.core import EngineConfig
from dualpace.errors import InvalidArgument
from dualpace.model.loader import LoadedModel
from dualpace.serve.auth import read_token_file
from dualpace.serve.config import parse_with_config
from dualpace.serve.engine_daemon import EngineDaemonParts, add_engine_arguments, build_engine, run_engine_daemon

log = logging.getLogger(__name__)
DEFAULT_KV_BLOCKS = 4096  # host memory is the plentiful resource
POLICIES = ("dualpace", "gated")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dualpace-cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser, default_name="cpu", default_kv_blocks=DEFAULT_KV_BLOCKS)
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="kernel backend (ipex: not available)")
    parser.add_argument("--assist", default="auto", choices=[s.value for s in AssistSetting],
                        help="Dense Assist per iteration: auto (the faster mode, measured), always, never")
    parser.add_argument("--gpu-service", default=None, help="gpu_service address for Dense Assist (HOST:PORT)")
    parser.add_argument("--assist-timeout-s", type=float, default=5.0,
                        help="an assisted iteration slower than this is redone locally")
    parser.add_argument("--policy", default="dualpace", choices=POLICIES,
                        help="dualpace: independent loop; gated: NEO-like baseline, CPU decodes advance only "
                             "inside GPU iterations with dense work on the GPU")
    parser.add_argument("--profile", default=None, help="hardware profile JSON (not implemented yet)")
    return parse_with_config(parser, argv)


def check_args(args: argparse.Namespace) -> None:
    select_backend(args.backend)
    if args.profile is not None:
        raise InvalidArgument("--profile", "profiles are not implemented yet; mode choice uses measured latencies")
    if args.assist == AssistSetting.ALWAYS.value and args.gpu_service is None:
        raise InvalidArgument("--assist", "always needs --gpu-service")
    if args.policy == "gated" and args.gpu_service is None:
        raise InvalidArgument("--policy", "gated needs --gpu-service (dense work always runs on the GPU)")
    if args.assist_timeout_s <= 0:
        raise InvalidArgument("--assist-timeout-s", f"must be positive, got {args.assist_timeout_s}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gated = args.policy == "gated"
    setting = AssistSetting.ALWAYS if gated else AssistSetting(args.assist)

    def make_runner(loaded: LoadedModel, config: EngineConfig) -> CpuRunner:
        client = None
        if args.gpu_service is not None and setting != AssistSetting.NEVER:
            client = AssistClient(args.gpu_service, iteration_timeout_s=args.assist_timeout_s,
                                  auth_token=read_token_file(args.auth_token_file))
        chooser = ModeChooser(setting, assist_configured=client is not None)
        return CpuRunner(loaded, config.num_kv_blocks, config.block_size, chooser, client, gated=gated,
                         engine_name=config.name)

    def build() -> EngineDaemonParts:
        check_args(args)
        return build_engine(args, kind="cpu", device="cpu", default_kv_blocks=DEFAULT_KV_BLOCKS,
                            make_runner=make_runner)

    return run_engine_daemon(args, "cpu_service", build)


if __name__ == "__main__":
    sys.exit(main())
