"""What a migration sends: its chunks, and where they come from (for in-place transports)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from dualpace.engine.transfer.kv_transfer import KvChunk
from dualpace.kv.storage import KVStorage


@dataclass
class OutgoingKv:
    """An async iterator of the transfer's chunks (the gRPC path reads them one by one), which also
    names the source pool and the request's slots, so a same-host transport can copy the blocks
    straight into the target instead (and never reads a chunk)."""

    storage: KVStorage
    slot_ids: list[int]  # the request's flat slots, tokens 0 .. num_computed_tokens - 1
    chunk_plan: list[tuple[int, int, int]]  # (layer, token_start, token_end) per chunk
    read_chunk: Callable[[int, int, int, int], Awaitable[KvChunk]]  # (seq, layer, start, end)
    # Called before each chunk and after the last: raises to abandon the move (a cancelled MigrateOut)
    safe_point: Callable[[], None] = lambda: None

    def __aiter__(self) -> AsyncIterator[KvChunk]:
        return self._chunks()

    async def read_ahead(self, depth: int) -> AsyncIterator[KvChunk]:
        """The chunks in order, with up to `depth` reads in flight at once (each read is a hop to a
        worker thread, whose latency then overlaps the others'); the safe point before each read's
        start and after the last chunk, as iterating does."""
        reads: deque[asyncio.Future] = deque()
        try:
            for seq, (layer, token_start, token_end) in enumerate(self.chunk_plan):
                self.safe_point()
                reads.append(asyncio.ensure_future(self.read_chunk(seq, layer, token_start, token_end)))
                if len(reads) >= max(1, depth):
                    yield await reads.popleft()
            while reads:
                yield await reads.popleft()
            self.safe_point()
        finally:
            for read in reads:  # abandoned part-way: the reads still in flight end unseen
                read.cancel()
            if reads:
                await asyncio.gather(*reads, return_exceptions=True)

    async def _chunks(self) -> AsyncIterator[KvChunk]:
        for seq, (layer, token_start, token_end) in enumerate(self.chunk_plan):
            self.safe_point()
            yield await self.read_chunk(seq, layer, token_start, token_end)
        self.safe_point()  # the last chance to back out: the sender commits next
