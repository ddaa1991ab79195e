"""The multi-turn driver: conversations start open-loop; inside one, each turn is sent when the
previous one has finished, with the whole history (openings, questions and the replies actually
generated) as its prompt. Bounded by timeout_s like bench.load.generator.run_load."""

from __future__ import annotations

import asyncio
import time

import grpc

from bench.load.generator import RunResult, _one, run_result
from toolkit.workload import RequestSpec
from bench.load.stats import RequestRecord
from bench.load.workloads import Conversation
from dualpace.wire.v1 import router_pb2_grpc


async def run_conversations(router: str, conversations: list[Conversation], *, seed: int = 0,
                            timeout_s: float = 600.0, run_tag: str = "0") -> RunResult:
    num_turns = max((len(c.turns) for c in conversations), default=0)
    records = [RequestRecord(c.index * num_turns + t, 0, n_out, scheduled_s=0.0)
               for c in conversations for t, (_, n_out) in enumerate(c.turns)]
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()

        async def converse(conversation: Conversation) -> None:
            await asyncio.sleep(conversation.arrival_s)
            history = list(conversation.opening_token_ids)
            for turn, (question, output_len) in enumerate(conversation.turns):
                record = records[conversation.index * num_turns + turn]
                prompt = history + list(question)
                record.scheduled_s, record.input_len = time.perf_counter(), len(prompt)
                spec = RequestSpec(record.index, record.scheduled_s - start, tuple(prompt), output_len)
                await _one(stub, spec, record, seed, run_tag, None)
                if not record.completed:
                    return  # the rest of this conversation is not sent
                history = prompt + record.output_token_ids

        tasks = [asyncio.create_task(converse(c)) for c in conversations]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return run_result(records, start)


def run_workload_records(args, rate: float, run_tag: str) -> tuple[RunResult, int]:
    """One run of a chat workload (bench.load.workloads): its records and how many requests it planned."""
    from bench.load.generator import run_load
    from bench.load.workloads import workload_plan

    plan = workload_plan(args, rate)
    if args.workload == "shared-prefix":
        return asyncio.run(run_load(args.router, plan, seed=args.seed, timeout_s=args.timeout_s,
                                    max_concurrency=args.max_concurrency, run_tag=run_tag)), len(plan)
    return (asyncio.run(run_conversations(args.router, plan, seed=args.seed, timeout_s=args.timeout_s,
                                          run_tag=run_tag)), sum(len(c.turns) for c in plan))


def workload_summary(args, result: RunResult, num_planned: int) -> dict:
    """The bench summary, with the workload's name and, for multi-turn, the median TTFT of each turn."""
    from bench.load.stats import summarize
    from bench.load.workloads import ttft_by_turn_ms

    summary = summarize(result.records, num_planned, result.duration_s, args.slo_ttft_ms, args.slo_itl_ms)
    summary["workload"] = args.workload
    if args.workload == "multi-turn":
        summary["ttft_p50_ms_by_turn"] = ttft_by_turn_ms(result.records, args.num_turns)
    return summary


def run_workload(args, rate: float, run_tag: str) -> dict:
    """One run of a chat workload -> {"rate_rps", "summary", "requests"}, like a plain bench run."""
    from bench.load.stats import request_rows

    result, num_planned = run_workload_records(args, rate, run_tag)
    return {"rate_rps": rate, "summary": workload_summary(args, result, num_planned),
            "requests": request_rows(result.records)}
