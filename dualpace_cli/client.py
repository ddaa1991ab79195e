"""`dualpace client`: send one request to a running router and stream the answer.

    dualpace client --router 127.0.0.1:50051 --chat "What is the capital of France?"
    dualpace client --router 127.0.0.1:50051 --prompt-ids 1,4093,198 --max-tokens 16 --json

Text is written as it arrives and ends its line; a one-line summary in brackets (engines,
tokens, finish reason, time to first token, decode speed) follows on stderr. --json prints one JSON object per streamed message.
A gRPC error is one line, `dualpace client: error: CODE: details`, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(subparsers) -> None:
    p = subparsers.add_parser("client", help="send a request to a running router and stream the answer")
    p.add_argument("--router", required=True, help="router address HOST:PORT (printed by `dualpace up`)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, tokenized as is")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--chat", help="a user message, rendered with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR", help="stop strings")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-id", default=None, help="client-chosen request id (default: the router assigns one)")
    p.add_argument("--json", action="store_true", help="one JSON object per streamed message")


def build_request(args: argparse.Namespace):
    from dualpace.client_request import ClientRequest
    from dualpace_cli.generate import parse_prompt_ids
    from dualpace.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos).validate()
    return ClientRequest(
        request_id=args.request_id,
        text=args.prompt,
        prompt_token_ids=parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None,
        messages=[{"role": "user", "content": args.chat}] if args.chat is not None else None,
        params=params,
    )


def summary_line(engines: list[str], usage: dict | None, num_tokens: int, finish_reason: str | None,
                 started: float, first_token: float | None, last_token: float | None) -> str:
    parts = [f"engine {' -> '.join(engines) or '-'}"]
    if usage is not None:
        parts.append(f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} generated tokens")
    else:
        parts.append(f"{num_tokens} generated tokens")
    parts.append(f"finish {finish_reason or 'none'}")
    if first_token is not None:
        parts.append(f"TTFT {1e3 * (first_token - started):.0f} ms")
        if num_tokens > 1 and last_token is not None and last_token > first_token:
            parts.append(f"{(num_tokens - 1) / (last_token - first_token):.1f} tokens/s")
    return "[" + ", ".join(parts) + "]"


def end_line(ends_line: bool) -> None:
    """The answer ends its line on stdout before anything goes to stderr (the summary, an error)."""
    if not ends_line:
        sys.stdout.write("\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    import grpc

    from dualpace.wire.router_messages import (
        client_request_to_pb,
        generate_response_to_dict,
    )
    from dualpace.wire.v1 import router_pb2_grpc

    request = client_request_to_pb(build_request(args))
    engines: list[str] = []
    num_tokens, usage, finish_reason = 0, None, None
    first_token = last_token = None
    ends_line = True  # nothing written yet, or the answer's text so far ends with a newline
    with grpc.insecure_channel(args.router) as channel:
        started = time.perf_counter()
        call = router_pb2_grpc.RouterStub(channel).Generate(request)
        try:
            for message in call:
                now = time.perf_counter()
                piece = generate_response_to_dict(message)
                if piece["token_ids"]:
                    num_tokens += len(piece["token_ids"])
                    first_token = first_token if first_token is not None else now
                    last_token = now
                if piece["engine"] and (not engines or engines[-1] != piece["engine"]):
                    engines.append(piece["engine"])
                if piece["usage"] is not None:
                    usage = piece["usage"]
                finish_reason = piece["finish_reason"] or finish_reason
                if args.json:
                    print(json.dumps(piece), flush=True)
                elif piece["text"]:
                    sys.stdout.write(piece["text"])
                    sys.stdout.flush()
                    ends_line = piece["text"].endswith("\n")
        except grpc.RpcError as exc:
            end_line(ends_line)
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            print(f"dualpace client: error: {code}: {exc.details()}", file=sys.stderr)
            return 2
        finally:
            call.cancel()  # no-op once the stream has ended; aborts the request on Ctrl-C
    end_line(ends_line)
    print(summary_line(engines, usage, num_tokens, finish_reason, started, first_token, last_token),
          file=sys.stderr, flush=True)
    return 0
