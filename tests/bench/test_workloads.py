"""The chat workloads' plans: seeded, a shared system prompt, conversations with their turns."""

from __future__ import annotations

import argparse

import pytest

from bench.load.workloads import add_workload_arguments, conversations, shared_prefix_requests
from dualpace.errors import InvalidArgument


def args_for(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for flag, default in (("--num-requests", 8), ("--seed", 3), ("--vocab-size", 500), ("--burstiness", 1.0)):
        parser.add_argument(flag, type=type(default), default=default)
    for flag in ("--output-len", "--input-len", "--trace"):
        parser.add_argument(flag, default=None)
    add_workload_arguments(parser)
    return parser.parse_args(argv)


def test_shared_prefix_requests_share_the_system_prompt_and_replay_exactly():
    args = args_for("--workload", "shared-prefix", "--system-len", "100", "--question-len", "5:9")
    specs = shared_prefix_requests(args, 2.0)
    assert len(specs) == 8 and len({s.prompt_token_ids[:100] for s in specs}) == 1
    assert len({s.prompt_token_ids[100:] for s in specs}) == 8
    assert all(5 <= s.input_len - 100 <= 9 and s.output_len == 32 for s in specs)
    assert shared_prefix_requests(args, 2.0) == specs
    assert [s.prompt_token_ids for s in shared_prefix_requests(args, 9.0)] == [s.prompt_token_ids for s in specs]


def test_conversations_have_their_own_openings_and_turns():
    args = args_for("--workload", "multi-turn", "--system-len", "30", "--num-turns", "3", "--output-len", "4")
    plan = conversations(args, 1.0)
    assert len(plan) == 2 and all(len(c.turns) == 3 for c in plan)
    assert plan[0].opening_token_ids != plan[1].opening_token_ids
    assert all(n_out == 4 for c in plan for _, n_out in c.turns)
    assert conversations(args, 1.0) == plan


@pytest.mark.parametrize("argv, flag", [
    (("--workload", "multi-turn", "--num-turns", "9"), "--num-requests"),
    (("--workload", "multi-turn", "--num-turns", "0"), "--num-turns"),
    (("--workload", "shared-prefix", "--system-len", "0"), "--system-len"),
    (("--workload", "shared-prefix", "--input-len", "4"), "--workload"),
    (("--workload", "shared-prefix", "--question-len", "x"), "--question-len"),
])
def test_bad_workload_arguments_name_their_flag(argv, flag):
    args = args_for(*argv)
    build = conversations if args.workload == "multi-turn" else shared_prefix_requests
    with pytest.raises(InvalidArgument, match=flag):
        build(args, 1.0)
