"""Host tier, source side: the GPU engine offers the prefix-cache blocks of each finished
request to the CPU engine's pool, so that they outlive their eviction from GPU memory.

The CPU engine's pool belongs to an engine that decodes: once the GPU engine has evicted a
conversation's history, the router can continue that conversation on the CPU engine, which
then prefills only the new tokens (router: dualpace.policy.host_tier).

When: a request that finished normally (stop or length) is offered after its step, from
this engine's loop, with the existing KV transfer (dualpace.engine.kv_transfer's header and
chunks, the same `send` as a migration) marked ``cache_only``. That is a write-through at
finish rather than a copy at eviction: an eviction happens inside the allocation of the step
that needs the block, whose forward pass overwrites it at once, so copying then would put a
device-to-host copy on the critical path of exactly the step that is short of KV. An offer
instead reads blocks that are still cached (pinned for the read, so the GPU engine cannot
evict them half-read), in the KV export pool, off the step loop.

What: the leading run of the request's full blocks that this engine's cache still holds
when the offer is made (found by hash, so a block evicted meanwhile ends the run and nothing
stale is read). Chains already accepted by the host tier are not sent again (a bounded
memory of their last block's hash). Offers wait in a bounded queue; when it is full the
oldest is dropped (counted): the tier is best-effort, a request never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dualpace.engine.kv_bytes import tensor_bytes
from dualpace.engine.kv_transfer import DEFAULT_CHUNK_BYTES, KvChunk, KvTransferHeader, checksum, plan_chunks
from dualpace.engine.loop import EngineLoop
from dualpace.engine.migration import SendTransfer, engine_kv_layout
from dualpace.engine.request import EngineRequest
from dualpace.engine.worker_pools import run_in_pool
from dualpace.errors import FailedPrecondition
from dualpace.sampling_params import FinishReason, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_OFFERS = 64
DEFAULT_MAX_REMEMBERED_CHAINS = 4096
PIN_PREFIX = "host-tier-offer:"  # table ids of the blocks pinned while an offer reads them


@dataclass
class HostTierCounts:
    num_offers: int = 0  # offers the host tier accepted
    num_offered_blocks: int = 0  # blocks sent in those
    num_failed: int = 0  # offers that failed (target down, refused, out of blocks)
    num_dropped: int = 0  # offers dropped unsent (queue full)
    num_skipped: int = 0  # offers with nothing to send (no block cached here any more, or sent before)
    last_error: str = ""


class HostTierOffers:
    """Offers finished requests' cached blocks to the host tier, one offer at a time."""

    def __init__(self, loop: EngineLoop, send: SendTransfer, max_pending: int = DEFAULT_MAX_PENDING_OFFERS,
                 max_remembered_chains: int = DEFAULT_MAX_REMEMBERED_CHAINS, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        scheduler = loop.core.scheduler
        if scheduler.prefix_cache is None:
            raise FailedPrecondition("the host tier needs prefix caching on (--prefix-caching on)")
        self.loop = loop
        self.send = send
        self.max_pending = max_pending
        self.max_remembered_chains = max_remembered_chains
        self.chunk_bytes = chunk_bytes
        self.counts = HostTierCounts()
        self._pending: deque[tuple[int, ...]] = deque()  # token ids of finished requests' full blocks
        self._sent_chains: OrderedDict[bytes, None] = OrderedDict()  # last block hash of chains sent
        self._next_offer = 0
        self._wake = asyncio.Event()
        self._event_loop = asyncio.get_running_loop()
        scheduler.finished_listener = self._finished

    # -------------------------------------------------------------- step thread

    def _finished(self, request: EngineRequest, reason: FinishReason) -> None:
        """Scheduler callback (in the step): queue the tokens of the request's full computed blocks."""
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        size = self.loop.core.scheduler.blocks.block_size
        num_full_blocks = min(request.num_computed_tokens // size, len(request.block_hashes))
        if num_full_blocks == 0:
            return
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self.counts.num_dropped += 1
        self._pending.append(tuple(request.token_ids(0, num_full_blocks * size)))
        try:
            self._event_loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the daemon's event loop has closed (shutting down): nothing will send it
            pass

    # -------------------------------------------------------------- event loop

    async def run(self) -> None:
        """Send queued offers until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self.offer(self._pending.popleft())

    async def offer(self, token_ids: tuple[int, ...]) -> int:
        """Send the cached leading blocks of `token_ids` to the host tier; the blocks sent (0: none)."""
        self._next_offer += 1
        pin_id = f"{PIN_PREFIX}{self.loop.core.config.name}:{self._next_offer}"
        try:
            pinned = await self.loop.call(lambda: self._pin(pin_id, token_ids))
        except Exception as exc:  # the engine is stopping: nothing to offer from
            self._failed(exc)
            return 0
        if pinned is None:
            self.counts.num_skipped += 1
            return 0
        num_tokens, last_hash, slot_ids = pinned
        try:
            await self.send(self._header(pin_id, token_ids[:num_tokens]), self._chunks(num_tokens, slot_ids))
        except Exception as exc:  # best-effort: the request it came from has finished already
            self._failed(exc)
            return 0
        finally:
            await self._unpin(pin_id)
        self._remember(last_hash)
        num_blocks = num_tokens // self.loop.core.scheduler.blocks.block_size
        self.counts.num_offers += 1
        self.counts.num_offered_blocks += num_blocks
        return num_blocks

    def _pin(self, pin_id: str, token_ids: tuple[int, ...]) -> tuple[int, bytes, list[int]] | None:
        """Between steps: hold the cached leading blocks of token_ids so no step evicts them."""
        scheduler = self.loop.core.scheduler
        hashes = scheduler.prefix_cache.hasher.chain(token_ids)
        block_ids = scheduler.blocks.match_prefix(hashes)
        if not block_ids or hashes[len(block_ids) - 1] in self._sent_chains:
            return None
        num_tokens = len(block_ids) * scheduler.blocks.block_size
        scheduler.blocks.allocate(pin_id, num_tokens, block_ids)
        return num_tokens, hashes[len(block_ids) - 1], self.loop.core.kv_slot_ids(pin_id, num_tokens)

    async def _unpin(self, pin_id: str) -> None:
        blocks = self.loop.core.scheduler.blocks
        try:
            await asyncio.shield(self.loop.call(lambda: blocks.free(pin_id) if blocks.has(pin_id) else None))
        except Exception:  # noqa: BLE001 - stopping: the pool goes with the engine
            pass

    def _header(self, pin_id: str, token_ids: tuple[int, ...]) -> KvTransferHeader:
        layout = engine_kv_layout(self.loop)
        num_tokens = len(token_ids)
        chunk_plan = plan_chunks(num_tokens, layout, self.chunk_bytes)
        core = self.loop.core
        return KvTransferHeader(
            request_id=pin_id, prompt_token_ids=token_ids, output_token_ids=(),
            params=SamplingParams(max_tokens=1, seed=0), num_computed_tokens=num_tokens, layout=layout,
            total_chunks=len(chunk_plan), total_bytes=2 * layout.num_layers * num_tokens * layout.bytes_per_token_per_layer,
            source_engine=core.config.name, cache_only=True, cache_salt=core.scheduler.prefix_cache.hasher.salt)

    async def _chunks(self, num_tokens: int, slot_ids: list[int]) -> AsyncIterator[KvChunk]:
        runner = self.loop.core.runner
        layout = engine_kv_layout(self.loop)

        def read(seq: int, layer: int, start: int, end: int) -> KvChunk:
            # Pinned blocks: no step writes or evicts them while this reads.
            k, v = runner.read_kv(slot_ids[start:end], layer)
            k_bytes, v_bytes = tensor_bytes(k), tensor_bytes(v)
            return KvChunk(seq, layer, start, end, k_bytes, v_bytes, checksum(k_bytes, v_bytes))

        for seq, (layer, start, end) in enumerate(plan_chunks(num_tokens, layout, self.chunk_bytes)):
            yield await run_in_pool("kv-export", read, seq, layer, start, end)

    def _remember(self, last_hash: bytes) -> None:
        self._sent_chains[last_hash] = None
        self._sent_chains.move_to_end(last_hash)
        while len(self._sent_chains) > self.max_remembered_chains:
            self._sent_chains.popitem(last=False)

    def _failed(self, exc: BaseException) -> None:
        self.counts.num_failed += 1
        self.counts.last_error = str(exc)
        if self.counts.num_failed == 1 or self.counts.num_failed % 100 == 0:
            log.warning("host tier: offer failed (%d so far): %s", self.counts.num_failed, exc)
