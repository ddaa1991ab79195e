"""The soak's command line (bench/soak.py): its flags, defaults and the derived values."""

from __future__ import annotations

import argparse
import sys

TINY = "tiny"  # --model default: the tiny-llama synthetic checkpoint, written to a temporary folder


def parse_soak_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=180.0, help="how long requests are sent")
    p.add_argument("--max-requests", type=int, default=None, help="bound on requests (default: rate x duration x 1.5)")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson at burstiness 1)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--model", default=TINY, help=f"'{TINY}' (synthetic tiny-llama), a known name, a folder or .gguf")
    p.add_argument("--dtype", default="fp32", choices=["auto", "fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--input-len", default="8:64")
    p.add_argument("--output-len", default="32:192",
                   help="prompt + output must fit gpu_service's pool alone: it prefills every request")
    p.add_argument("--vocab-size", type=int, default=500, help="prompt ids are drawn below it")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--gpu-kv-blocks", type=int, default=40, help="small: the router hands off and migrates")
    p.add_argument("--cpu-kv-blocks", type=int, default=2048)
    p.add_argument("--assist", default="never", choices=["auto", "always", "never"], help="cpu_service --assist")
    p.add_argument("--step-delay-ms", type=int, default=None,
                   help="DUALPACE_FAULT_STEP_DELAY_MS for the engines: a floor on the step time, so that requests "
                        "overlap and the pools fill without burning CPU (default 10 with the tiny model, else 0)")
    p.add_argument("--cancel-frac", type=float, default=0.10)
    p.add_argument("--invalid-frac", type=float, default=0.05)
    p.add_argument("--restart", default="cpu", choices=["cpu", "gpu", "none"], help="engine SIGKILLed and restarted")
    p.add_argument("--restart-at-s", type=float, default=None, help="when (default: half the duration)")
    p.add_argument("--restart-wait-busy-s", type=float, default=15.0,
                   help="from --restart-at-s, wait up to this long for the engine to hold a request before the kill")
    p.add_argument("--restart-down-s", type=float, default=1.0, help="how long the engine stays down")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="RSS baseline this long into the load (and after the restart); default min(20, duration/4)")
    p.add_argument("--request-deadline-s", type=float, default=120.0,
                   help="each request's gRPC deadline; DEADLINE_EXCEEDED counts as lost (hung)")
    p.add_argument("--max-rss-growth-pct", type=float, default=10.0)
    p.add_argument("--orphan-timeout-s", type=float, default=3.0, help="the engines' lease for unread requests")
    p.add_argument("--no-chaos-extra", action="store_true",
                   help="without the orphaned requests, stalled assist session and 10 MB prompt (bench/soak_chaos.py)")
    p.add_argument("--progress-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress stays on stderr)")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.duration_s <= 0 or args.rate <= 0:
        p.error("--duration-s and --rate must be positive")
    if args.restart_at_s is None:
        args.restart_at_s = args.duration_s / 2
    if args.warmup_s is None:
        args.warmup_s = min(20.0, args.duration_s / 4)
    if args.step_delay_ms is None:
        args.step_delay_ms = 10 if args.model == TINY else 0
    if args.max_requests is None:
        args.max_requests = max(1, int(args.rate * args.duration_s * 1.5) + 10)
    return args
