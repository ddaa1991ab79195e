"""Chat-shaped workloads for `dualpace bench --workload`: what prefix caching is for. Pure, seeded.

- ``shared-prefix``: every request is one system prompt of ``--system-len`` tokens (the same for
  all) followed by its own question (``--question-len``), arriving open-loop at ``--rate``;
- ``multi-turn``: ``--num-requests / --num-turns`` conversations start open-loop at ``--rate``; each
  opens with its own context of ``--system-len`` tokens and then, turn after turn, resends its whole
  history (every earlier message and the model's actual replies) plus a new question. A turn is sent
  when the previous one has finished (a user reads the reply first), so the driver is closed-loop
  inside a conversation (bench.load.conversations).

Prompts are random token ids from their own seeded streams, so a run with prefix caching on and
one with it off send exactly the same tokens (and, greedy with ignore_eos, get the same replies).
cold_twin: the same prompt with its first token changed, so no prefix cache holds any block of it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from toolkit.workload import LengthSpec, RequestSpec, _stream, arrival_times, parse_length_spec, random_prompt
from dualpace.errors import InvalidArgument

WORKLOADS = ("random", "shared-prefix", "multi-turn")
_SYSTEM, _QUESTIONS, _OUTPUTS = 11, 12, 13  # seed streams, apart from toolkit.workload's ones


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="random", choices=WORKLOADS,
                        help="random: --input-len/--output-len or --trace; shared-prefix and multi-turn: "
                             "chat traffic that a prefix cache serves (see bench/load/workloads.py)")
    parser.add_argument("--system-len", type=int, default=1000,
                        help="shared-prefix: the shared system prompt; multi-turn: each conversation's opening")
    parser.add_argument("--question-len", default="16:64", help="SPEC of each new question")
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")


@dataclass(frozen=True)
class Conversation:
    """One multi-turn conversation: when it starts, its opening, and (question, output_len) per turn."""

    index: int
    arrival_s: float
    opening_token_ids: tuple[int, ...]
    turns: tuple[tuple[tuple[int, ...], int], ...]


def _lengths(args: argparse.Namespace) -> tuple[LengthSpec, LengthSpec]:
    if args.system_len < 1:
        raise InvalidArgument("--system-len", f"must be >= 1, got {args.system_len}")
    if args.trace is not None or args.input_len is not None:
        raise InvalidArgument("--workload", f"{args.workload} makes its own prompts: drop --trace/--input-len")
    return (parse_length_spec(args.question_len, "--question-len"),
            parse_length_spec(args.output_len or "32", "--output-len"))


def shared_prefix_requests(args: argparse.Namespace, rate: float) -> list[RequestSpec]:
    question_len, output_len = _lengths(args)
    system = random_prompt(args.system_len, args.vocab_size, _stream(args.seed, _SYSTEM))
    questions, outputs = _stream(args.seed, _QUESTIONS), _stream(args.seed, _OUTPUTS)
    times = arrival_times(args.num_requests, rate, args.burstiness, args.seed)
    return [RequestSpec(i, at, system + random_prompt(question_len.sample(questions), args.vocab_size, questions),
                        output_len.sample(outputs)) for i, at in enumerate(times)]


def conversations(args: argparse.Namespace, rate: float) -> list[Conversation]:
    question_len, output_len = _lengths(args)
    if args.num_turns < 1:
        raise InvalidArgument("--num-turns", f"must be >= 1, got {args.num_turns}")
    num_conversations = args.num_requests // args.num_turns
    if num_conversations < 1:
        raise InvalidArgument("--num-requests", f"multi-turn needs at least --num-turns ({args.num_turns}) "
                              f"requests, got {args.num_requests}")
    openings, questions, outputs = (_stream(args.seed, p) for p in (_SYSTEM, _QUESTIONS, _OUTPUTS))
    times = arrival_times(num_conversations, rate, args.burstiness, args.seed)
    return [Conversation(i, at, random_prompt(args.system_len, args.vocab_size, openings),
                         tuple((random_prompt(question_len.sample(questions), args.vocab_size, questions),
                                output_len.sample(outputs)) for _ in range(args.num_turns)))
            for i, at in enumerate(times)]


def ttft_by_turn_ms(records, num_turns: int) -> list[float | None]:
    """Median TTFT (ms) of each turn over the completed conversations' requests (index = conversation
    * num_turns + turn): the later turns show what resending the history costs."""
    from dualpace.stats import percentile

    by_turn: list[list[float]] = [[] for _ in range(num_turns)]
    for record in records:
        ttft = record.ttft_s() if record.completed else None
        if ttft is not None:
            by_turn[record.index % num_turns].append(ttft * 1e3)
    return [round(percentile(v, 50), 2) if v else None for v in by_turn]


def workload_plan(args: argparse.Namespace, rate: float) -> list:
    """What --workload sends: RequestSpecs (shared-prefix) or Conversations (multi-turn)."""
    if args.workload == "shared-prefix":
        return shared_prefix_requests(args, rate)
    return conversations(args, rate)


def cold_twin(prompt_token_ids: list[int], vocab_size: int) -> list[int]:
    """prompt_token_ids with its first token replaced by another id in [1, vocab_size): the same length and
    the same later tokens, but every block's chained hash differs from the original's."""
    if vocab_size < 3:
        raise ValueError(f"a cold twin needs a vocabulary of at least 3 ids, got {vocab_size}")
    if not prompt_token_ids:
        raise ValueError("a cold twin needs at least one prompt token")
    return [prompt_token_ids[0] % (vocab_size - 1) + 1] + list(prompt_token_ids[1:])
