"""Two-phase KV migration between engines, independent of the transport.

Source (`migrate_out`): pause the request at a step boundary, stream its KV to
the target, and only after the target commits end the request's stream here with
a `migrated_to` event (at once, without waiting for a step boundary, so the client
resumes on the target without delay) and free its blocks (at the next boundary,
before returning). Any failure before the commit resumes the request on the
source; nothing is lost. Cancelling migrate_out's caller never strands the request: before
the KV is all sent the move is abandoned and the request resumes here, after it the move
completes (see migrate_out).

Target (`KvImporter`): reserve blocks when the header arrives; the transport's import side
(kv_shm_import, kv_tcp_import) lands the KV in them and verifies it; prepare checks that it
did, and commit makes the request live. Any failure or a stream that ends before commit frees
the reserved blocks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from dualpace.engine.channel import RequestChannel
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_bytes import DTYPE_NAMES
from dualpace.engine.transfer.kv_transfer import ImportProgress, KvLayout, KvTransferHeader
from dualpace.engine.loop import EngineLoop
from dualpace.engine.request import EngineRequest, RequestEvent, RequestState
from dualpace.errors import InvalidArgument, Overloaded, Unavailable
from dualpace.validation import validate_request

log = logging.getLogger(__name__)

# send(header, outgoing) moves a transfer to the target and returns the target engine's
# name once it has committed; it raises if anything fails before that.
SendTransfer = Callable[[KvTransferHeader, OutgoingKv], Awaitable[str]]


@dataclass(frozen=True)
class MigrationStats:
    target_engine: str
    total_bytes: int
    duration_ms: float


def engine_kv_layout(loop: EngineLoop) -> KvLayout:
    kv = loop.core.runner.kv
    return KvLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, DTYPE_NAMES[kv.dtype])


class MigrationAbandoned(Unavailable):
    """The caller of migrate_out went away (its RPC was cancelled) before the KV was all sent."""


async def migrate_out(
    loop: EngineLoop, request_id: str, send: SendTransfer, migrated_to: str | None = None,
) -> MigrationStats:
    """Move the request; its stream here ends with `migrated_to` (default: the target engine's name),
    which over gRPC is the target's address, where the client resumes.

    The move runs as a task of its own, so cancelling the caller (the MigrateOut RPC: a router
    restart, a deadline) never strands the request paused with its blocks. It stops at the next
    safe point instead: until the KV is all sent, the transfer is abandoned (the sender ends
    the import, the target frees what it reserved) and the request resumes here; after that the
    move completes (the target's commit decides) and the release frees the blocks here."""
    abandon = asyncio.Event()
    move = asyncio.ensure_future(_move(loop, request_id, send, migrated_to, abandon))
    try:
        return await asyncio.shield(move)
    except asyncio.CancelledError:
        abandon.set()
        _ABANDONED_MOVES.add(move)  # a strong reference until it ends (the event loop keeps weak ones)
        move.add_done_callback(_log_abandoned_move)
        raise


_ABANDONED_MOVES: set[asyncio.Future] = set()


def _log_abandoned_move(move: asyncio.Future) -> None:
    _ABANDONED_MOVES.discard(move)
    if move.cancelled():
        return
    if (error := move.exception()) is not None:
        log.info("migrate out: cancelled by its caller; %s", error)
    else:
        log.info("migrate out: cancelled by its caller after the KV was sent; committed on %s",
                 move.result().target_engine)


async def _move(
    loop: EngineLoop, request_id: str, send: SendTransfer, migrated_to: str | None, abandon: asyncio.Event,
) -> MigrationStats:
    start = time.perf_counter()
    core = loop.core
    layout = engine_kv_layout(loop)

    def pause() -> tuple[EngineRequest, list[int]]:
        request = core.scheduler.pause(request_id)
        # Queued or preempted, or its sliding layers' KV in a pool of their own: moves without KV.
        if request.num_computed_tokens == 0 or not core.moves_kv:
            return request, []
        return request, core.kv_slot_ids(request_id, request.num_computed_tokens)

    # Held after its first token for this hand-off: taken now, not at the boundary after the step in flight.
    held = loop.holds.take(request_id)
    request, slot_ids = held if held is not None else await loop.call(pause)
    paused = time.perf_counter()
    num_sent_tokens = request.num_computed_tokens if core.moves_kv else 0  # else: the target recomputes
    total_bytes = 2 * layout.num_layers * num_sent_tokens * layout.bytes_per_token_per_layer
    header = KvTransferHeader(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        output_token_ids=tuple(request.output_token_ids),
        params=replace(request.params, seed=request.seed),
        num_computed_tokens=num_sent_tokens,
        layout=layout,
        total_bytes=total_bytes,
        source_engine=core.config.name,
        num_cached_tokens=request.num_cached_tokens or 0,
        num_prior_output_tokens=request.num_prior_output_tokens,
    )

    def check_abandoned() -> None:
        if abandon.is_set():
            raise MigrationAbandoned(f"migrate out of {request_id!r} cancelled by its caller before the commit")

    try:
        check_abandoned()  # cancelled while the pause waited for a step boundary
        # The transport reads the slots in its own threads, without the step lock: the request is
        # paused, so no step writes them.
        outgoing = OutgoingKv(core.runner.kv, slot_ids, safe_point=check_abandoned)
        target_engine = await send(header, outgoing)
    except BaseException:
        # Shielded: a cancelled command is skipped, and the request would stay paused for good.
        await asyncio.shield(_resume_if_paused(loop, request_id))
        raise
    sent = time.perf_counter()
    destination = migrated_to or target_engine
    # Committed: the request lives on the target from now on. End its stream here at once, so the
    # client resumes there without waiting for this engine's step in flight (a long prefill step
    # would hold the next boundary, and the tokens the target makes meanwhile, for a whole step).
    # The request stays PAUSED here (no step touches it) until the release below frees its blocks
    # at the next step boundary; MigrateOut returns after that, as before.
    await loop.dispatch([RequestEvent(request_id, migrated_to=destination)])

    def release() -> None:
        if request_id in core.scheduler.requests:  # not aborted in between
            core.scheduler.release(request_id, migrated_to=destination)  # its event: already sent above

    try:
        await asyncio.shield(loop.call(release))
    except Unavailable:  # this engine stopped meanwhile: its blocks go with it; the move itself succeeded
        log.info("migrate out: %s committed on %s; this engine stopped before freeing its blocks",
                 request_id, destination)
    released = time.perf_counter()
    log.debug("migrate out phases: request %s%s, pause wait %.1f ms, send %.1f ms, release wait %.1f ms",
              request_id, " (held after its first token)" if held is not None else "", (paused - start) * 1e3, (sent - paused) * 1e3, (released - sent) * 1e3)
    return MigrationStats(target_engine, total_bytes, (time.perf_counter() - start) * 1e3)


async def _resume_if_paused(loop: EngineLoop, request_id: str) -> None:
    def resume() -> None:
        request = loop.core.scheduler.requests.get(request_id)
        if request is not None and request.state == RequestState.PAUSED:
            loop.core.scheduler.resume(request_id)

    await loop.call(resume)


RESERVED_AHEAD_PREFIX = "reserved-ahead-"  # + random hex: the scheduler's id of blocks reserved ahead


def _check_layout(layout: KvLayout, own: KvLayout, field: str) -> None:
    if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (own.num_layers, own.num_kv_heads, own.head_dim):
        raise InvalidArgument(field, f"KV shape {layout} does not match this engine's model {own}")
    if layout.dtype not in ("float32", "bfloat16", "float16"):
        raise InvalidArgument(f"{field}.dtype", f"unknown dtype {layout.dtype!r}")


class KvImporter:
    """One incoming transfer on the target engine."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.progress: ImportProgress | None = None
        self._slot_runs: tuple[tuple[int, int], ...] = ()
        self._reserved = False
        self._reserved_ahead: str | None = None  # the scheduler's id of blocks reserved before the header
        self._committed = False
        self.marks: list[tuple[str, float]] = []  # (event, perf_counter s) for the import's debug log

    @property
    def reserved_ahead(self) -> bool:
        """Blocks were reserved ahead of this import's header (reserve_ahead), which begin adopts."""
        return self._reserved_ahead is not None

    async def reserve_ahead(self, layout: KvLayout, num_tokens: int) -> None:
        """Reserve slots for `num_tokens` tokens of KV of a transfer whose header comes later; begin
        hands them to its request (cut to its tokens). Refused (Overloaded) where they would leave
        less than half of this engine's pool available: they are held for a transfer that may not come."""
        core = self.loop.core
        _check_layout(layout, engine_kv_layout(self.loop), "shm_reserve_ahead.layout")
        if not core.moves_kv:
            raise InvalidArgument("shm_reserve_ahead", "this engine's sliding layers hold a KV pool of their own")
        if not 0 < num_tokens < core.loaded.max_context_tokens:
            raise InvalidArgument("shm_reserve_ahead.num_tokens", f"must be 1 to {core.loaded.max_context_tokens - 1}")
        reserved_id = f"{RESERVED_AHEAD_PREFIX}{secrets.token_hex(8)}"

        def reserve() -> tuple[tuple[int, int], ...]:
            self.loop.check_accepting()
            blocks = core.scheduler.blocks
            if blocks.num_available_blocks - blocks.num_blocks_for(num_tokens + 1) < blocks.num_total_blocks // 2:
                raise Overloaded(f"{num_tokens} tokens reserved ahead would leave under half of the KV pool free")
            core.scheduler.reserve_import(reserved_id, num_tokens, ahead=True)
            self._reserved, self._reserved_ahead = True, reserved_id
            return blocks.slot_runs(reserved_id, 0, num_tokens)

        self._slot_runs = await self.loop.call(reserve)

    async def begin(self, header: KvTransferHeader) -> None:
        """Check the header and reserve its blocks (or adopt those reserved ahead)."""
        core = self.loop.core
        layout = header.layout
        _check_layout(layout, engine_kv_layout(self.loop), "header.layout")
        num_tokens = len(header.prompt_token_ids) + len(header.output_token_ids)
        kv_complete = bool(header.output_token_ids) and header.num_computed_tokens == num_tokens - 1
        if header.num_computed_tokens != 0 and not kv_complete:
            raise InvalidArgument("header.num_computed_tokens",
                                  "must cover every token but the last sampled one, or be 0 (recompute here)")
        if header.num_computed_tokens != 0 and not core.moves_kv:
            raise InvalidArgument("header.num_computed_tokens", "this engine's sliding layers hold a KV pool of "
                                                                "their own: it takes requests without KV (0) only")
        remaining = header.params.max_tokens - len(header.output_token_ids)
        if remaining < 1:
            raise InvalidArgument("header.output_token_ids", "the request has already produced max_tokens tokens")
        # The continuation is valid exactly when the original request was: same total length.
        min_tokens_left = max(0, header.params.min_tokens - len(header.output_token_ids))
        validate_request(header.prompt_token_ids + header.output_token_ids,
                         replace(header.params, max_tokens=remaining, min_tokens=min_tokens_left),
                         core.loaded.config.vocab_size, core.loaded.max_context_tokens,
                         prompt_field="header.prompt_token_ids")

        ahead = self._reserved_ahead

        def reserve() -> tuple[tuple[int, int], ...]:
            self.loop.check_accepting()  # a draining engine takes no imports; the source keeps the request
            if ahead is None:
                core.scheduler.reserve_import(header.request_id, header.num_computed_tokens)
            else:
                core.scheduler.adopt_import(ahead, header.request_id, header.num_computed_tokens)
            # Recorded in the command itself: a caller cancelled while awaiting it must still free the blocks.
            self._reserved = True
            self.progress = ImportProgress(header)
            # New blocks: none released to a sliding window yet, so the table's slots are the request's.
            return core.scheduler.blocks.slot_runs(header.request_id, 0, header.num_computed_tokens)

        self._slot_runs = await self.loop.call(reserve)

    @property
    def slot_runs(self) -> tuple[tuple[int, int], ...]:
        """The reserved slots of tokens 0 .. num_computed_tokens - 1 as (first slot, number of slots) runs
        of consecutive slots, in order (KVBlockManager.slot_runs)."""
        return self._slot_runs

    @property
    def slot_ids(self) -> list[int]:
        """The reserved slots of tokens 0 .. num_computed_tokens - 1, in order."""
        return [slot for start, length in self._slot_runs for slot in range(start, start + length)]

    async def prepare(self) -> ImportProgress:
        progress = self._require_header()
        progress.check_complete()
        return progress

    async def commit(self, wake_loop: bool = True) -> str:
        """Make the request live here; returns this engine's name. wake_loop=False: an idle engine
        starts its first step only once the caller calls loop.wake() (EngineLoop.call)."""
        progress = await self.prepare()
        header = progress.header
        request = EngineRequest(
            request_id=header.request_id,
            prompt_token_ids=list(header.prompt_token_ids),
            params=header.params,
            seed=header.params.seed,
            output_token_ids=list(header.output_token_ids),
            num_prior_output_tokens=header.num_prior_output_tokens,  # the penalties' counts: rebuilt from the tokens
            # Without KV the request is prefilled here, and looks up this engine's cache then.
            num_cached_tokens=header.num_cached_tokens if header.num_computed_tokens else None,
        )
        channel = RequestChannel(header.request_id, len(header.prompt_token_ids), list(header.output_token_ids))
        channel.num_cached_tokens = request.num_cached_tokens or 0

        def commit() -> None:
            self.loop.core.scheduler.commit_import(request)
            self.loop.add_channel(channel)
            self._committed = True  # in the command: a caller cancelled meanwhile must not cancel a live import

        await self.loop.call(commit, wake=wake_loop)
        return self.loop.core.config.name

    async def cancel(self) -> None:
        """Free the reserved blocks unless the request was committed. Shielded: when the
        import's RPC is cancelled (the source went away) this runs in its cleanup, and a
        cancelled command would be skipped, leaking the blocks."""
        if self._reserved and not self._committed:
            request_id = self.progress.header.request_id if self.progress is not None else self._reserved_ahead
            self._reserved = False
            await asyncio.shield(self.loop.call(lambda: self.loop.core.scheduler.cancel_import(request_id)))

    def _require_header(self) -> ImportProgress:
        if self.progress is None:
            raise InvalidArgument("header", "the first message of an import must be its header")
        return self.progress
