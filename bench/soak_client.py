"""The soak's client side: an open-loop stream of requests to the router with chaos mixed in
(client cancellations after a random number of tokens, invalid requests), and the
classification of every request into exactly one outcome.

Outcomes (`RequestOutcome.status`):
    completed          the stream ended with the expected finish reason and token count
    cancelled          the client cancelled it after `cancel_after` tokens (as planned)
    invalid_rejected   an invalid request answered with INVALID_ARGUMENT (as required)
    failed             ended with an explicit gRPC error (`code`), or a finish reason ERROR/ABORT
    wrong              ended "successfully" but with the wrong token count or finish reason,
                       or an invalid request that was not rejected with INVALID_ARGUMENT
    lost               no terminal event (the stream ended without a finish reason), or it
                       hung past its deadline (DEADLINE_EXCEEDED, or the client's watchdog)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from dualpace.wire.v1 import common_pb2, router_pb2, router_pb2_grpc
from toolkit.workload import RequestSpec

NORMAL, CANCEL, INVALID = "normal", "cancel", "invalid"
COMPLETED, CANCELLED, INVALID_REJECTED, FAILED, WRONG, LOST = (
    "completed", "cancelled", "invalid_rejected", "failed", "wrong", "lost")
WATCHDOG_SLACK_S = 15.0  # past the gRPC deadline: the client stops waiting and calls the request lost

FINISH_NAMES = {v.number: v.name.removeprefix("FINISH_REASON_") for v in common_pb2.FinishReason.DESCRIPTOR.values}


def _sampling(max_tokens: int, seed: int, **overrides) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **overrides)


def _tokens(ids) -> common_pb2.TokenIds:
    return common_pb2.TokenIds(token_ids=list(ids))


# Each invalid variant breaks one field; the router must answer INVALID_ARGUMENT before placing it.
INVALID_VARIANTS = {
    "max_tokens=0": lambda rid, ids, seed: router_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=_tokens(ids), sampling=_sampling(0, seed)),
    "temperature<0": lambda rid, ids, seed: router_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=_tokens(ids), sampling=_sampling(8, seed, temperature=-1.0)),
    "top_p>1": lambda rid, ids, seed: router_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=_tokens(ids), sampling=_sampling(8, seed, top_p=1.5)),
    "token id out of vocab": lambda rid, ids, seed: router_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=_tokens([*ids, 4_000_000]), sampling=_sampling(8, seed)),
    "empty text": lambda rid, ids, seed: router_pb2.GenerateRequest(
        request_id=rid, text="", sampling=_sampling(8, seed)),
    "no prompt": lambda rid, ids, seed: router_pb2.GenerateRequest(request_id=rid, sampling=_sampling(8, seed)),
    "bad request_id": lambda rid, ids, seed: router_pb2.GenerateRequest(
        request_id=rid + " with spaces", prompt_token_ids=_tokens(ids), sampling=_sampling(8, seed)),
}


@dataclass
class SoakRequest:
    spec: RequestSpec
    kind: str  # NORMAL | CANCEL | INVALID
    cancel_after: int | None = None  # CANCEL: tokens received before the client cancels
    invalid_variant: str | None = None  # INVALID: which field is broken

    @property
    def request_id(self) -> str:
        return f"soak-{self.spec.index}"


@dataclass
class RequestOutcome:
    request: SoakRequest
    status: str | None = None
    code: str | None = None  # gRPC status code name, or FINISH_<reason> for an error finish
    detail: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    engines: list[str] = field(default_factory=list)
    sent_s: float | None = None  # time.monotonic()
    end_s: float | None = None


def plan_requests(specs: list[RequestSpec], cancel_frac: float, invalid_frac: float, seed: int) -> list[SoakRequest]:
    """Assign each spec a kind (seeded): invalid with invalid_frac, cancelled with cancel_frac."""
    rng = random.Random(seed * 7919 + 17)
    variants = sorted(INVALID_VARIANTS)
    planned = []
    for spec in specs:
        draw = rng.random()
        if draw < invalid_frac:
            planned.append(SoakRequest(spec, INVALID, invalid_variant=variants[rng.randrange(len(variants))]))
        elif draw < invalid_frac + cancel_frac and spec.output_len >= 2:
            planned.append(SoakRequest(spec, CANCEL, cancel_after=rng.randint(1, spec.output_len - 1)))
        else:
            planned.append(SoakRequest(spec, NORMAL))
    return planned


def _message(request: SoakRequest, seed: int) -> router_pb2.GenerateRequest:
    spec = request.spec
    if request.kind == INVALID:
        return INVALID_VARIANTS[request.invalid_variant](request.request_id, spec.prompt_token_ids, seed + spec.index)
    return router_pb2.GenerateRequest(request_id=request.request_id, prompt_token_ids=_tokens(spec.prompt_token_ids),
                                      sampling=_sampling(spec.output_len, seed + spec.index))


def _classify_end(outcome: RequestOutcome, cancelled_by_client: bool) -> None:
    request = outcome.request
    if request.kind == INVALID:
        outcome.status, outcome.detail = WRONG, f"invalid request ({request.invalid_variant}) was accepted"
        return
    if cancelled_by_client:
        outcome.status = CANCELLED
        return
    if outcome.finish_reason is None:
        outcome.status, outcome.detail = LOST, "stream ended without a finish reason"
    elif outcome.finish_reason in ("ERROR", "ABORT"):
        outcome.status, outcome.code = FAILED, f"FINISH_{outcome.finish_reason}"
    elif outcome.finish_reason != "LENGTH" or outcome.num_tokens != request.spec.output_len:
        outcome.status = WRONG
        outcome.detail = (f"finish {outcome.finish_reason} after {outcome.num_tokens} tokens, "
                          f"expected LENGTH after {request.spec.output_len}")
    else:
        outcome.status = COMPLETED


def _classify_error(outcome: RequestOutcome, exc: grpc.aio.AioRpcError) -> None:
    code = exc.code().name
    outcome.code, outcome.detail = code, (exc.details() or "")[:200]
    if outcome.request.kind == INVALID:
        outcome.status = INVALID_REJECTED if code == "INVALID_ARGUMENT" else WRONG
        if outcome.status == WRONG:
            outcome.detail = f"invalid request ({outcome.request.invalid_variant}) got {code}: {outcome.detail}"
    elif code == "DEADLINE_EXCEEDED":
        outcome.status = LOST  # hung past its deadline
    else:
        outcome.status = FAILED


async def run_one(stub: router_pb2_grpc.RouterStub, outcome: RequestOutcome, seed: int, deadline_s: float) -> None:
    """Send one request, read its stream, classify how it ended (never raises but CancelledError)."""
    request = outcome.request
    outcome.sent_s = time.monotonic()
    call = stub.Generate(_message(request, seed), timeout=deadline_s)

    async def consume() -> bool:
        async for message in call:
            outcome.num_tokens += len(message.token_ids)
            if message.token_ids and message.engine and (not outcome.engines or outcome.engines[-1] != message.engine):
                outcome.engines.append(message.engine)
            if message.finish_reason:
                outcome.finish_reason = FINISH_NAMES.get(message.finish_reason, str(message.finish_reason))
            if (request.kind == CANCEL and outcome.finish_reason is None
                    and outcome.num_tokens >= request.cancel_after):
                call.cancel()
                return True
        return False

    try:
        cancelled = await asyncio.wait_for(consume(), deadline_s + WATCHDOG_SLACK_S)
        _classify_end(outcome, cancelled)
    except grpc.aio.AioRpcError as exc:
        _classify_error(outcome, exc)
    except asyncio.CancelledError:
        # The client's own cancel surfaces as CancelledError in some grpc versions.
        if request.kind == CANCEL and call.cancelled() and outcome.num_tokens >= (request.cancel_after or 0):
            outcome.status = CANCELLED
        else:
            raise
    except TimeoutError:
        outcome.status, outcome.detail = LOST, f"no terminal event within {deadline_s + WATCHDOG_SLACK_S:.0f} s"
    finally:
        outcome.end_s = time.monotonic()
        call.cancel()  # no-op once ended


@dataclass
class Tally:
    """Counts over the outcomes (what the progress line and the summary print)."""
    sent: int = 0
    done: int = 0
    by_status: Counter = field(default_factory=Counter)
    failed_by_code: Counter = field(default_factory=Counter)

    @classmethod
    def of(cls, outcomes: list[RequestOutcome]) -> Tally:
        tally = cls()
        for outcome in outcomes:
            if outcome.sent_s is None:
                continue
            tally.sent += 1
            if outcome.status is not None:
                tally.done += 1
                tally.by_status[outcome.status] += 1
                if outcome.status == FAILED:
                    tally.failed_by_code[outcome.code or "?"] += 1
        return tally


async def run_chaos_load(router: str, requests: list[SoakRequest], *, seed: int, duration_s: float,
                         deadline_s: float, outcomes: list[RequestOutcome],
                         started: asyncio.Event | None = None) -> float:
    """Send each request at its arrival time (open loop) for at most duration_s, then wait for all
    of them to end (each is bounded by its deadline plus the watchdog slack). `outcomes` is filled
    in place (one per request sent) so that a progress task can read it. Returns the send window (s)."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.monotonic()
        if started is not None:
            started.set()
        tasks: list[asyncio.Task] = []
        for request in requests:
            due = start + request.spec.arrival_s
            if due - start >= duration_s:
                break
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = RequestOutcome(request)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(run_one(stub, outcome, seed, deadline_s)))
        window_s = time.monotonic() - start
        if tasks:
            # Every task ends by itself (deadline + watchdog); this bound is a second safety net.
            _, pending = await asyncio.wait(tasks, timeout=deadline_s + 2 * WATCHDOG_SLACK_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for outcome in outcomes:
                if outcome.status is None:
                    outcome.status, outcome.detail = LOST, "still running when the soak stopped waiting"
    return window_s
