"""Relay: one client request from admission to its last token.

Admits it (GPU, CPU via a hand-off after the GPU prefill, wait, or reject),
follows it across migrations (resuming the stream on the target from the next
token index), and recovers it when its engine dies (re-submitting prompt +
generated tokens, with the same seed, to a survivor, or, when no survivor can
ever hold it, to the same engine once it is back on its address), so the client
sees one unbroken stream: no token missing, none repeated. Text is detokenized
incrementally and stop strings end the request (router/text_stream.py).
`open_request` is the start both front doors (gRPC, HTTP) share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from dualpace.client_request import ClientRequest
from dualpace.errors import InvalidArgument, Overloaded, Unavailable
from dualpace.policy.admission import Placement, admit, handoff_source
from dualpace.policy.policies import traits
from dualpace.kv.prefix_index import longest_cached_prefix
from dualpace.policy.host_tier import HostTierChoice, place_host_prefix
from dualpace.logprobs import TokenLogprobs
from dualpace.sampling_params import FinishReason, SamplingParams
from dualpace.serve.logging_setup import bind_request_id, unbind_request_id
from dualpace.serve.metrics import RequestClock, engine_metrics
from router.engines import EngineHandle, EngineStream
from router.router_core import RouterCore, Tracked
from router.text_stream import TextStream

log = logging.getLogger(__name__)

# Codes that mean "this engine is gone or failing", so the request moves to a survivor.
ENGINE_FAILURE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True)
class RelayUpdate:
    token_ids: list[int]
    text: str
    engine: str
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprobs | None, ...] = ()  # per token_ids entry, when sampling.logprobs is set
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # on the first update, when asked for


@dataclass(frozen=True)
class Moved:
    """How following an engine's stream ended when it did not finish: the request moved there."""

    target: EngineHandle


# A request that cannot continue is answered UNAVAILABLE this long before its client's
# deadline, so the client learns why instead of seeing DEADLINE_EXCEEDED.
DEADLINE_MARGIN_S = 0.25


class Relay:
    def __init__(self, core: RouterCore, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 client_deadline: float | None = None):
        """client_deadline: the client's deadline on the time.monotonic() clock (None: none)."""
        self.core = core
        self.client_deadline = client_deadline
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params  # the seed is fixed, so recovery and migration continue the same draws
        self.output_token_ids: list[int] = []
        self.tracked = Tracked(request_id, len(prompt_token_ids), params.max_tokens)
        self.text = TextStream(core.tokenizer, prompt_token_ids, params.stop, params.min_tokens)
        self.engine_base = 0  # outputs that are part of the current engine request's prompt
        self.finished = False
        self.clock = RequestClock()  # Prometheus latencies as the client sees them, by serving engine
        self.num_cached_tokens = 0  # prompt tokens an engine served from its prefix cache (its final usage)
        # An engine known to hold this prompt's KV now (a sibling choice of the same prompt was just
        # prefilled there): admission prefers it, so the full blocks are shared through its prefix cache.
        self.prompt_cached_on: str | None = None
        self.refused_by: set[str] = set()  # engines that refused to continue it after a failure

    # ----------------------------------------------------------------- public

    async def run(self) -> AsyncIterator[RelayUpdate]:
        self.core.tracked[self.request_id] = self.tracked
        bind_request_id(self.request_id)  # on every line logged for this request (and sent to the engines)
        try:
            engine, handoff_to = await self._admit()
            log.info("admitted on %s%s (%d prompt tokens)", engine.name,
                     f", hand-off to {handoff_to.name}" if handoff_to is not None else "", len(self.prompt_token_ids))
            engine_metrics(engine.name).prompt_tokens.inc(len(self.prompt_token_ids))
            call = self._submit(engine, hold_after_first_token=self._holds(handoff_to))
            recovered = False
            lost: EngineHandle | None = None  # the engine that last failed under this request
            while True:
                try:
                    async for item in self._follow(engine, call, handoff_to):
                        if isinstance(item, Moved):
                            break
                        self._observe(item)
                        yield item
                        if item.finish_reason is not None:
                            return
                    else:
                        raise Unavailable(f"engine {engine.name} ended the stream without finishing")
                    engine, handoff_to = item.target, None
                    self.tracked.engine = engine
                    call = self._resume(engine)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in ENGINE_FAILURE_CODES:
                        if exc.code() == grpc.StatusCode.DATA_LOSS:  # this request alone failed: say so
                            raise
                        if not recovered:
                            raise
                        # The engine refused the continuation (e.g. its pool is too small): another
                        # one, or the engine that failed once it is back, continues it.
                        if lost is None or engine is lost:
                            raise Unavailable(f"request {self.request_id} cannot continue on {engine.name}: "
                                              f"{exc.code().name}: {exc.details()}") from None
                        log.info("%s refused the continuation (%s: %s)", engine.name, exc.code().name,
                                 exc.details())
                        self.refused_by.add(engine.name)
                        engine, call = await self._recover(lost)
                        continue
                    log.warning("engine %s failed under %s (%s); recovering", engine.name, self.request_id,
                                exc.code().name)
                    await engine.mark_unhealthy()
                    lost = engine
                    remaining = self.params.max_tokens - len(self.output_token_ids)
                    if remaining <= 0:
                        update = self._final(engine, FinishReason.LENGTH)
                        self._observe(update)
                        yield update
                        return
                    if not self.output_token_ids and not recovered:
                        # Nothing reached the client yet (the engine refused the request while
                        # draining, or died before its first token): admit it again as a new
                        # request, so it waits for room like one, and is refused UNAVAILABLE at
                        # once when no engine is up instead of waiting for one to come back.
                        await self._abort_quietly(engine)
                        engine, handoff_to = await self._admit()
                        log.info("re-admitted on %s", engine.name)
                        call = self._submit(engine, hold_after_first_token=self._holds(handoff_to))
                        recovered = True
                        continue
                    engine, call = await self._recover(engine)
                    handoff_to, recovered = None, True
        finally:
            self.core.tracked.pop(self.request_id, None)
            self.core.notify()
            if not self.finished:
                await self._abort_in_engine()
            unbind_request_id()

    def _observe(self, update: RelayUpdate) -> None:
        metrics = engine_metrics(update.engine)
        self.clock.tokens(metrics, len(update.token_ids))
        if update.finish_reason is not None:
            self.clock.finished(metrics, update.finish_reason.value)

    # ----------------------------------------------------------------- admission

    async def _admit(self) -> tuple[EngineHandle, EngineHandle | None]:
        core = self.core
        deadline = self._bounded(time.monotonic() + core.config.queue_timeout_s)
        queued = False
        try:
            while True:
                views = core.pool.views()
                cached = longest_cached_prefix(core.pool.prefix_index, list(views), self.prompt_token_ids)
                if self.prompt_cached_on in cached:
                    cached[self.prompt_cached_on] = len(self.prompt_token_ids)
                host = place_host_prefix(len(self.prompt_token_ids), self.params.max_tokens, views, core.placed(),
                                         core.config.admission, cached, core.config.host_tier)
                if host is not None and host.choice is HostTierChoice.CONTINUE_ON_CPU:
                    # Its prefix lives in the CPU engine's cache: decode and prefill there.
                    self.tracked.engine = core.pool.by_name(host.cpu_engine)
                    return self.tracked.engine, None
                if host is not None and await self._copy_back(host.cpu_engine, host.gpu_engine):
                    self.tracked.engine = core.pool.by_name(host.gpu_engine)
                    return self.tracked.engine, None
                placement, name = admit(len(self.prompt_token_ids), self.params.max_tokens, views,
                                        core.placed(), core.num_queued, core.config.admission, cached)
                if placement in (Placement.GPU, Placement.CPU):
                    engine = core.pool.by_name(name)
                    if placement == Placement.CPU:
                        gpus = [h for h in core.pool.of_kind("gpu") if h.healthy and h.view is not None]
                        source = handoff_source(len(self.prompt_token_ids), self.params.max_tokens,
                                                [h.view for h in gpus])
                        if source is not None:  # prefill on the GPU engine, then hand the KV to the CPU engine
                            self.tracked.engine = next(h for h in gpus if h.view.name == source)
                            return self.tracked.engine, engine
                    self.tracked.engine = engine
                    return engine, None
                if placement == Placement.REJECT:
                    if not any(h.healthy for h in core.pool.handles):
                        raise Unavailable("no engine is available")
                    raise Overloaded("no engine can take this request now and the router's queue is full")
                if not queued:
                    queued = True
                    core.num_queued += 1
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise Overloaded(f"no engine had room within {core.config.queue_timeout_s:g} s"
                                     " (or before the client's deadline)")
                await core.wait_for_change(min(remaining_s, 0.5))
        finally:
            if queued:
                core.num_queued -= 1

    async def _copy_back(self, cpu_name: str, gpu_name: str) -> bool:
        """Copy the CPU engine's cached prefix of the prompt into the GPU engine's cache (CopyPrefix);
        False, and the usual placement, when that fails: recomputing is always correct."""
        cpu, gpu = self.core.pool.by_name(cpu_name), self.core.pool.by_name(gpu_name)
        try:
            num_tokens, num_sent, duration_ms = await cpu.copy_prefix(self.prompt_token_ids, gpu.address)
        except grpc.aio.AioRpcError as exc:
            log.warning("copy of the cached prefix from %s to %s failed: %s %s", cpu_name, gpu_name,
                        exc.code().name, exc.details())
            return False
        log.info("copied %d cached prompt tokens (%d sent) from %s to %s in %.1f ms", num_tokens, num_sent,
                 cpu_name, gpu_name, duration_ms)
        return num_tokens > 0

    def _holds(self, handoff_to: EngineHandle | None) -> bool:
        """Whether the prefilling engine holds the request after its first token for the hand-off."""
        return handoff_to is not None and traits(self.core.config.policy).holds_for_handoff

    def _submit(self, engine: EngineHandle, params: SamplingParams | None = None,
                hold_after_first_token: bool = False) -> EngineStream:
        """A new engine request: the prompt plus what was relayed so far (after a failure).
        hold_after_first_token: a hand-off follows its first token (the engine holds it for the move)."""
        prompt = self.prompt_token_ids + self.output_token_ids
        self.engine_base = len(self.output_token_ids)
        params = params or self.params
        if params.guided is not None:  # the grammar consumes the re-submitted outputs first
            params = replace(params, guided=replace(params.guided, num_output_tokens_in_prompt=self.engine_base))
        return engine.generate(self.request_id, prompt, params, self.engine_base, hold_after_first_token)

    def _resume(self, engine: EngineHandle) -> EngineStream:
        """Follow the same engine request on `engine` from the first output not yet relayed."""
        return engine.resume(self.request_id, len(self.output_token_ids) - self.engine_base)

    # ----------------------------------------------------------------- following

    async def _follow(self, engine: EngineHandle, call: EngineStream,
                      handoff_to: EngineHandle | None) -> AsyncIterator[RelayUpdate | Moved]:
        """The client's updates from one engine stream, ending with a finished update, or with
        Moved(target) when the engine handed the request on; a stream that just ends is neither."""
        handoff_started = False
        async for update in call:
            if update.num_cached_tokens is not None:  # a re-submission's prompt includes outputs: cap it
                self.num_cached_tokens = min(update.num_cached_tokens, len(self.prompt_token_ids))
            expected = len(self.output_token_ids) - self.engine_base
            new_ids = list(update.new_token_ids)
            logprobs = update.logprobs
            if update.first_token_index < expected:  # already relayed (a resume overlapping): skip them
                new_ids = new_ids[expected - update.first_token_index:]
                logprobs = logprobs[expected - update.first_token_index:]
            elif update.first_token_index > expected:
                raise Unavailable(f"engine {engine.name} skipped tokens ({update.first_token_index} > {expected})")
            if new_ids:
                self.output_token_ids.extend(new_ids)
                self.tracked.num_generated_tokens = len(self.output_token_ids)
                text, stopped = self.text.push(new_ids)
                extra = {"logprobs": logprobs, "prompt_logprobs": update.prompt_logprobs}
                if stopped:
                    yield self._final(engine, FinishReason.STOP, new_ids, text, abort=True, **extra)
                    return
                reason = update.finish_reason
                if reason is not None:
                    text += self.text.finish()
                    yield self._final(engine, reason, new_ids, text, **extra)
                    return
                yield RelayUpdate(new_ids, text, engine.name, None, **extra)
                if handoff_to is not None and not handoff_started:
                    handoff_started = True
                    self.core.spawn(self.core.migrate(self.tracked, handoff_to, "handoff"))
            elif update.finish_reason is not None:
                text = self.text.finish()
                yield self._final(engine, update.finish_reason, [], text)
                return
            if update.migrated_to is not None:
                target = self.core.pool.by_address(update.migrated_to)
                if target is None:
                    raise Unavailable(f"request moved to an unknown engine at {update.migrated_to}")
                self.core.notify()
                yield Moved(target)
                return

    def _final(self, engine: EngineHandle, reason: FinishReason, token_ids: list[int] | None = None,
               text: str = "", abort: bool = False, **logprobs) -> RelayUpdate:
        self.finished = not abort  # a stop string still needs the engine request aborted
        return RelayUpdate(token_ids or [], text, engine.name, reason, **logprobs)

    # ----------------------------------------------------------------- recovery

    async def _recover(self, failed: EngineHandle):
        """Continue on another engine that could hold the request: resume there if it already holds
        it (a migration committed just before the failure), else re-submit prompt + outputs. When no
        other engine could ever hold it (its pool is too small, or it refused the continuation), the
        request waits, paused, for `failed` to come back on its address (restarted by `dualpace up`
        or systemd), at most --resume-wait-s, and continues there."""
        core = self.core
        started = time.monotonic()
        while True:
            others = [h for h in core.pool.handles
                      if h is not failed and h.name not in self.refused_by and self._could_hold(h)]
            waiting = not others
            if waiting and self.tracked.waiting_for is None:
                log.warning("no other engine can hold %s: waiting for %s at %s to come back", self.request_id,
                            failed.name, failed.address)
            self.tracked.waiting_for = failed.name if waiting else None
            for engine in [*others, failed]:  # the others first: `failed` once it is back
                call = await self._continue_on(engine) if engine.healthy else None
                if call is not None:
                    if waiting:
                        log.info("%s is back: continuing %s there", engine.name, self.request_id)
                    self.tracked.waiting_for = None
                    return engine, call
            bound_s = core.config.resume_wait_s if waiting else core.config.recovery_timeout_s
            deadline = self._bounded(started + bound_s)
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                if waiting:
                    ended_by = ("before the client's deadline" if deadline < started + bound_s
                                else f"within {bound_s:g} s (--resume-wait-s)")
                    raise Unavailable(f"request {self.request_id} waited for engine {failed.name} at "
                                      f"{failed.address} to come back (no other engine can hold it); it did not "
                                      f"come back {ended_by}")
                raise Unavailable(f"no surviving engine could take request {self.request_id}")
            await core.wait_for_change(min(remaining_s, 0.5))

    def _could_hold(self, engine: EngineHandle) -> bool:
        """Whether the engine's whole pool (as last seen) fits the request at its final size."""
        final_tokens = len(self.prompt_token_ids) + self.params.max_tokens - 1
        return engine.view is not None and engine.view.could_ever_hold(final_tokens)

    async def _continue_on(self, engine: EngineHandle) -> EngineStream | None:
        """The request's stream on `engine`: resumed when it holds the request already, else
        re-submitted with prompt + outputs; None when the engine does not answer."""
        try:
            held = await engine.list_requests(timeout_s=5)
        except grpc.aio.AioRpcError:
            return None
        self.tracked.engine = engine
        if any(info.request_id == self.request_id for info in held):
            # Same lineage, same outputs: only the stream moves.
            return self._resume(engine)
        return self._submit(engine, continuation_params(self.params, len(self.output_token_ids)))

    def _bounded(self, deadline: float) -> float:
        """`deadline`, or earlier when the client's own deadline comes first (less a margin)."""
        if self.client_deadline is None:
            return deadline
        return min(deadline, self.client_deadline - DEADLINE_MARGIN_S)

    async def _abort_quietly(self, engine: EngineHandle) -> None:
        """Best effort: a failed engine that is still up must not keep the request."""
        try:
            await engine.abort(self.request_id, timeout_s=1)
        except grpc.aio.AioRpcError:
            pass  # gone, or never held it

    async def _abort_in_engine(self) -> None:
        engine = self.tracked.engine
        if engine is None:
            return
        try:
            await engine.abort(self.request_id, timeout_s=5)
        except grpc.aio.AioRpcError:
            pass  # already finished, moved or gone


def continuation_params(params: SamplingParams, num_generated: int) -> SamplingParams:
    """A re-submission's parameters after `num_generated` tokens: what is left of max_tokens and
    min_tokens, and no prompt logprobs (the client has them: they came with the first token)."""
    return replace(params, max_tokens=params.max_tokens - num_generated,
                   min_tokens=max(0, params.min_tokens - num_generated), prompt_logprobs=None)


async def open_request(core: RouterCore, client: ClientRequest, request_id: str, client_deadline: float | None = None,
                 default_max_tokens: int | None = None) -> Relay:
    """What every front door does before relaying: refuse a request id that is already
    running, tokenize and validate the prompt off the event loop (router.prompt_work), and with `default_max_tokens`
    (the client set none) fit that default to the room the prompt leaves in the context."""
    if request_id in core.tracked:
        raise InvalidArgument("request_id", f"request {request_id!r} is already running")
    prompt_ids, params = await core.prompt_work.prepare(client, core.tokenizer, core.model_config)
    if default_max_tokens:
        room = core.max_context_tokens - len(prompt_ids)
        params = replace(params, max_tokens=max(1, min(default_max_tokens, room)))
    return Relay(core, request_id, prompt_ids, params, client_deadline)
