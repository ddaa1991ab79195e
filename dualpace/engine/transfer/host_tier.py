"""Host tier, source side: the GPU engine offers the prefix-cache blocks of each finished
request to the CPU engine's pool, so that they outlive their eviction from GPU memory.

The CPU engine's pool belongs to an engine that decodes: once the GPU engine has evicted a
conversation's history, the router can continue that conversation on the CPU engine, which
then prefills only the new tokens (router: dualpace.policy.host_tier).

When: a request that finished normally (stop or length) is offered after its step, from
this engine's loop, with the existing KV transfer (dualpace.engine.transfer.kv_transfer's header,
the KV over the target's TCP data socket, as a migration to another host sends it) marked
``cache_only``. That is a write-through at
finish rather than a copy at eviction: an eviction happens inside the allocation of the step
that needs the block, whose forward pass overwrites it at once, so copying then would put a
device-to-host copy on the critical path of exactly the step that is short of KV. An offer
instead reads blocks that are still cached (pinned for the read, so the GPU engine cannot
evict them half-read), in the KV export pool, off the step loop.

What: the leading run of the request's full blocks that this engine's cache still holds
when the offer is made (found by hash, so a block evicted meanwhile ends the run and nothing
stale is read). Chains already accepted by the host tier are not offered again (a bounded
memory of their last block's hash), and of a chain that extends one sent before only the new
blocks travel: the target answers the header with the leading tokens it holds (skip_cached,
dualpace.engine.transfer.prefix_copy, which also does the pin, read and send). Offers wait in a bounded queue; when it is full the
oldest is dropped (counted): the tier is best-effort, a request never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.prefix_copy import SendCache, send_cached_prefix
from dualpace.engine.request import EngineRequest
from dualpace.errors import FailedPrecondition
from dualpace.sampling_params import FinishReason

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
    num_sent_tokens: int = 0  # tokens whose KV the accepted offers sent (the host tier held the rest)
    last_error: str = ""


class HostTierOffers:
    """Offers finished requests' cached blocks to the host tier, one offer at a time."""

    def __init__(self, loop: EngineLoop, send: SendCache, max_pending: int = DEFAULT_MAX_PENDING_OFFERS,
                 max_remembered_chains: int = DEFAULT_MAX_REMEMBERED_CHAINS):
        scheduler = loop.core.scheduler
        if scheduler.prefix_cache is None:
            raise FailedPrecondition("the host tier needs prefix caching on (--prefix-caching on)")
        if not loop.core.moves_kv:
            raise FailedPrecondition("the host tier moves KV between engines, and this model's sliding layers hold "
                                     "a KV pool of their own, which no transfer carries (EngineCore.moves_kv)")
        self.loop = loop
        self.send = send
        self.max_pending = max_pending
        self.max_remembered_chains = max_remembered_chains
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
        """Send the cached leading blocks of `token_ids` to the host tier; the blocks sent (0: none).
        Blocks the host tier caches already are not sent again (skip_cached)."""
        self._next_offer += 1
        pin_id = f"{PIN_PREFIX}{self.loop.core.config.name}:{self._next_offer}"
        try:
            copy = await send_cached_prefix(self.loop, self.send, token_ids, pin_id, skip_chains=self._sent_chains)
        except Exception as exc:  # best-effort: the request it came from has finished already
            self._failed(exc)
            return 0
        if copy is None:
            self.counts.num_skipped += 1
            return 0
        self._remember(copy.last_block_hash)
        num_blocks = copy.num_tokens // self.loop.core.scheduler.blocks.block_size
        self.counts.num_offers += 1
        self.counts.num_offered_blocks += num_blocks
        self.counts.num_sent_tokens += copy.num_sent_tokens
        return num_blocks

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
