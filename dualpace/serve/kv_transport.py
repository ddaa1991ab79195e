"""The gRPC transport of a KV migration: stream a transfer to the target's ImportKv."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvChunk, KvTransferHeader
from dualpace.engine.transfer.prefix_copy import SourceFrom
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.serve.auth import token_metadata
from dualpace.serve.peer_channels import TRANSFER_TIMEOUT_S, PeerChannels
from dualpace.serve.security import TlsConfig, peer_channel
from dualpace.serve.server import channel_options
from dualpace.wire.engine_messages import kv_header_to_pb
from dualpace.wire.kv_chunk_wire import (
    IMPORT_KV_METHOD,
    encode_chunk_batch,
    encode_kv_chunk_message,
    serialize_import_message,
)
from dualpace.wire.v1 import engine_pb2

# Chunks go together in one message while their K + V bytes stay within this (0: one message per
# chunk; a larger chunk goes alone): the chunk size limit itself, 4 MiB. Bare gRPC moved
# 4 MB messages faster than 0.75 or 8 MB ones (Intel Xeon with AMX), and a 1024-token
# transfer (0.79 MB chunks) took 48 / 66 ms batched to 4 MiB against 56 / 69 ms to 1 MiB.
DEFAULT_BATCH_BYTES = 4 * 2**20
READ_AHEAD_CHUNKS = 8  # chunks read (or being read) before the writes take them (a chunk is at most 4 MiB)
_END = None


async def _read_into(chunks: AsyncIterator[KvChunk], ready: asyncio.Queue, faults: FaultConfig) -> None:
    """Puts each chunk to send (after fault injection) on `ready`, then None; or the error that ended it."""
    try:
        async for chunk in chunks:
            outgoing = faults.outgoing_chunk(chunk)
            if outgoing is not None:
                await ready.put(outgoing)
    except Exception as exc:  # noqa: BLE001 - raised where the writes take it (e.g. a cancelled move)
        await ready.put(exc)
        return
    await ready.put(_END)


async def _next_ready(ready: asyncio.Queue) -> KvChunk | None:
    item = await ready.get()
    if isinstance(item, BaseException):
        raise item
    return item


class GrpcKvSender:
    """send(header, chunks) for dualpace.engine.transfer.migration.migrate_out, over one ImportKv stream.

    Whatever ends the import before the commit (the target rejects a chunk, the link
    drops) raises Unavailable with the target's status in its message, so MigrateOut
    fails with one code however the failure was noticed."""

    def __init__(self, target_address: str, faults: FaultConfig | None = None, timeout_s: float = TRANSFER_TIMEOUT_S,
                 auth_token: str | None = None, tls: TlsConfig | None = None,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, channels: PeerChannels | None = None):
        self.target_address = target_address
        # Channels kept open across transfers (dualpace.serve.peer_channels): a 1-token transfer took
        # 8.5 / 11.3 ms on a kept channel against 12.9 / 14.6 ms on a fresh one.
        # None: a channel of its own per transfer, closed after it.
        self.channels = channels
        self.faults = faults or FaultConfig()
        self.timeout_s = timeout_s
        self.auth_token = auth_token  # the shared --auth-token-file token the target requires, if any
        self.tls = tls  # this daemon's TLS settings: a TLS engine reaches its TCP peers over TLS
        self.batch_bytes = batch_bytes
        self.num_messages = 0  # chunk messages written by the last call (a batch counts once)

    @contextlib.asynccontextmanager
    async def _channel(self):
        if self.channels is None:
            async with peer_channel(self.target_address, self.tls, channel_options()) as channel:
                yield channel
            return
        channel = self.channels.get(self.target_address, self.tls)
        try:
            yield channel
        except BaseException:
            self.channels.drop(self.target_address, self.tls, channel)  # the next transfer connects afresh
            raise

    async def __call__(self, header: KvTransferHeader, chunks: AsyncIterator[KvChunk]) -> str:
        async with self._channel() as channel:
            call = self._open_import(channel)
            try:
                await self._write(call, kv_header_to_pb(header), "the header")
                await self._send_chunks(call, chunks)
                return await self._prepare_and_commit(call)
            except BaseException:
                call.cancel()  # the target drops the partial import
                raise

    async def send_cache(self, header: KvTransferHeader, source_from: SourceFrom) -> tuple[str, int]:
        """A cache-only import with skip_cached (dualpace.engine.transfer.prefix_copy.SendCache): the target
        answers the header with the leading tokens it holds, and only the chunks after them are sent.
        Returns (the target engine's name, those held tokens)."""
        header = replace(header, skip_cached=True)
        async with self._channel() as channel:
            call = self._open_import(channel)
            try:
                await self._write(call, kv_header_to_pb(header), "the header")
                held = await self._expect(call, "cache_held")
                await self._send_chunks(call, source_from(held.num_held_tokens))
                return await self._prepare_and_commit(call), held.num_held_tokens
            except BaseException:
                call.cancel()  # the target drops the partial import and its hold on the shared blocks
                raise

    def _open_import(self, channel):
        """The ImportKv stream; chunks go pre-encoded, straight from the exported KV buffers (one copy:
        dualpace.wire.kv_chunk_wire), every other message as a protobuf message."""
        import_kv = channel.stream_stream(IMPORT_KV_METHOD, request_serializer=serialize_import_message,
                                          response_deserializer=engine_pb2.ImportKvReply.FromString)
        return import_kv(timeout=self.timeout_s, metadata=token_metadata(self.auth_token))

    async def _send_chunks(self, call, chunks: AsyncIterator[KvChunk]) -> None:
        """Every chunk, read ahead of the writes: while one gRPC message is written (a wait for its
        completion) the next chunks are read (each a hop to a worker thread), and the chunks read
        meanwhile go together as one KvChunkBatch message of up to batch_bytes (a short context's
        many small chunks: a few messages, not one per layer)."""
        self.num_messages = 0
        ready: asyncio.Queue = asyncio.Queue(READ_AHEAD_CHUNKS)
        if isinstance(chunks, OutgoingKv):  # several reads in flight (a migration's chunks)
            chunks = chunks.read_ahead(READ_AHEAD_CHUNKS)
        reader = asyncio.ensure_future(_read_into(chunks, ready, self.faults))
        batches = self.batch_bytes > 0
        try:
            while (chunk := await _next_ready(ready)) is not None:
                batch, size = [chunk], len(chunk.k) + len(chunk.v)
                while batches and not ready.empty():
                    following = ready._queue[0]  # noqa: SLF001 - a peek: asyncio.Queue has none
                    if following is None or isinstance(following, BaseException):
                        break  # the end or an error: the outer loop takes it
                    if size + len(following.k) + len(following.v) > self.batch_bytes:
                        break
                    batch.append(ready.get_nowait())
                    size += len(following.k) + len(following.v)
                message = encode_kv_chunk_message(chunk) if len(batch) == 1 else encode_chunk_batch(batch)
                await self._write(call, message, f"chunk {chunk.seq}" if len(batch) == 1
                                  else f"chunks {chunk.seq}-{batch[-1].seq}")
                self.num_messages += 1
        finally:
            if not reader.done():  # a write failed (or the move was cancelled) with reads ahead
                reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _prepare_and_commit(self, call) -> str:
        """The second phase; returns the target engine's name once it has committed."""
        await self._write(call, engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()), "prepare")
        await self._expect(call, "prepared")
        await self._write(call, engine_pb2.ImportKvMessage(commit=engine_pb2.ImportKvCommit()), "commit")
        committed = await self._expect(call, "committed")
        await call.done_writing()
        return committed.engine

    @staticmethod
    async def _write(call, message: engine_pb2.ImportKvMessage | bytes, what: str) -> None:
        try:
            await call.write(message)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            # The target already ended the stream (e.g. it rejected an earlier chunk): whether
            # the write notices that is a race, so report it like an early end of the replies.
            raise await _ended(call, f"while sending {what}") from None

    @staticmethod
    async def _expect(call, kind: str):
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError:  # the target ended the stream with an error status
            raise await _ended(call, f"before '{kind}'") from None
        if reply is grpc.aio.EOF:
            # The target ended the stream: its status says why (e.g. a corrupt chunk).
            await call.wait_for_connection()
            raise await _ended(call, f"before '{kind}'")
        if reply.WhichOneof("kind") != kind:
            raise Unavailable(f"KV import replied {reply.WhichOneof('kind')!r}, expected {kind!r}")
        return getattr(reply, kind)


async def _ended(call, when: str) -> Unavailable:
    """The error for an import the target ended early, with the target's status in its message."""
    code = await call.code()
    details = await call.details()
    return Unavailable(f"KV import ended {when}: {code.name if code else 'unknown'}: {details}")
