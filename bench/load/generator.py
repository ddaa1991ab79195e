"""The asyncio open-loop driver: sends RequestSpecs to the router's Generate stream (grpc.aio) at
their arrival times and records each request's timings. Bounded in count (the specs given) and
time (timeout_s: requests still running are cancelled and fail with DEADLINE_EXCEEDED; requests
not yet due are not sent). send_one: one request, waited for (closed loop)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from bench.load.stats import OK, RequestRecord
from dualpace.sampling_params import SamplingParams
from dualpace.wire.router_messages import (
    ClientRequest,
    client_request_to_pb,
    generate_response_to_dict,
)
from dualpace.wire.v1 import router_pb2_grpc
from toolkit.workload import RequestSpec

DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.name


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last end


def _request_pb(spec: RequestSpec, seed: int, run_tag: str):
    params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, seed=seed + spec.index)
    return client_request_to_pb(ClientRequest(request_id=f"bench-{run_tag}-{spec.index}", text=None,
                                              prompt_token_ids=list(spec.prompt_token_ids), messages=None,
                                              params=params))


async def _one(stub, spec: RequestSpec, record: RequestRecord, seed: int, run_tag: str,
               slots: asyncio.Semaphore | None) -> None:
    if slots is not None:
        await slots.acquire()
    call = None
    try:
        record.sent_s = time.perf_counter()
        call = stub.Generate(_request_pb(spec, seed, run_tag))
        async for message in call:
            now = time.perf_counter()
            piece = generate_response_to_dict(message)
            record.messages.append((now, len(piece["token_ids"])))
            record.output_token_ids.extend(piece["token_ids"])
            if piece["usage"] is not None:
                record.num_cached_tokens = piece["usage"]["cached_tokens"]
            if piece["engine"]:
                record.tokens_by_engine[piece["engine"]] += len(piece["token_ids"])
            if piece["engine"] and (not record.engines or record.engines[-1] != piece["engine"]):
                record.engines.append(piece["engine"])
            if piece["finish_reason"]:
                record.finish_reason = piece["finish_reason"]
        record.status = OK
    except grpc.aio.AioRpcError as exc:
        record.status = exc.code().name
        record.detail = (exc.details() or "")[:200]
    except asyncio.CancelledError:
        record.status = DEADLINE_EXCEEDED
        record.detail = "still running at the benchmark timeout; cancelled"
        raise
    finally:
        record.end_s = time.perf_counter()
        if call is not None:
            call.cancel()  # no-op once the stream has ended
        if slots is not None:
            slots.release()


async def run_load(router: str, specs: list[RequestSpec], *, seed: int = 0, timeout_s: float = 600.0,
                   max_concurrency: int | None = None, run_tag: str = "0") -> RunResult:
    """Send every spec at its arrival time (open loop), wait for all to end or timeout_s."""
    records = [RequestRecord(s.index, s.input_len, s.output_len, scheduled_s=0.0) for s in specs]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()
        deadline = start + timeout_s
        tasks: list[asyncio.Task] = []

        async def dispatch() -> None:
            for spec, record in zip(specs, records):
                due = start + spec.arrival_s
                record.scheduled_s = due
                if due >= deadline:
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(stub, spec, record, seed, run_tag, slots)))

        dispatcher = asyncio.create_task(dispatch())
        try:
            await asyncio.wait_for(asyncio.shield(dispatcher), max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)
        remaining = max(0.0, deadline - time.perf_counter())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return run_result(records, start)


def run_result(records: list[RequestRecord], start_s: float) -> RunResult:
    """The records, and the run's duration from the first send to the last end."""
    sent = [r for r in records if r.sent_s is not None]
    first = min((r.sent_s for r in sent), default=start_s)
    last = max((r.end_s for r in sent if r.end_s is not None), default=first)
    return RunResult(records, last - first)


def send_one(router: str, index: int, prompt: list[int], output_len: int, tag: str,
             timeout_s: float = 600.0) -> dict:
    """Closed loop: send one request and wait for it; SystemExit naming it if it does not complete."""
    result = asyncio.run(run_load(router, [RequestSpec(index, 0.0, tuple(prompt), output_len)], timeout_s=timeout_s,
                                  run_tag=tag))
    record = result.records[0]
    if not record.completed:
        raise SystemExit(f"request {index} failed: {record.status} {record.detail}")
    return {"prompt_tokens": len(prompt), "ttft_ms": round(record.ttft_s() * 1e3, 2),
            "e2e_ms": round((record.end_s - record.sent_s) * 1e3, 2), "num_output_tokens": record.num_tokens,
            "engines": record.engines, "cached_tokens": record.num_cached_tokens,
            "output_token_ids": record.output_token_ids}
