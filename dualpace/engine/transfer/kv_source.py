"""What a migration sends: its chunks, and where they come from (for in-place transports)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from dualpace.engine.transfer.kv_transfer import KvChunk
from dualpace.kv.storage import KVStorage


@dataclass
class OutgoingKv:
    """The source pool and the request's slots, which the transports copy (shared memory) or stream
    (the data socket) straight from, and an async iterator of the transfer's chunks read from them
    (an in-process import's: tests/engine)."""

    storage: KVStorage
    slot_ids: list[int]  # the request's flat slots, tokens 0 .. num_computed_tokens - 1
    chunk_plan: list[tuple[int, int, int]]  # (layer, token_start, token_end) per chunk
    read_chunk: Callable[[int, int, int, int], Awaitable[KvChunk]]  # (seq, layer, start, end)
    # Called before each chunk and after the last: raises to abandon the move (a cancelled MigrateOut)
    safe_point: Callable[[], None] = lambda: None

    def __aiter__(self) -> AsyncIterator[KvChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[KvChunk]:
        for seq, (layer, token_start, token_end) in enumerate(self.chunk_plan):
            self.safe_point()
            yield await self.read_chunk(seq, layer, token_start, token_end)
        self.safe_point()  # the last chance to back out: the sender commits next
