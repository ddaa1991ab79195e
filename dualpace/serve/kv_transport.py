"""The control plane of a KV transfer: the target's ImportKv stream, over gRPC.

It carries the header, the target's answers, the two-phase prepare and commit; the KV bytes go
over shared memory or the target's TCP data socket (the subclasses in kv_shm_transport and
kv_tcp_transport). On its own it moves a request without KV (the target recomputes it)."""

from __future__ import annotations

import asyncio
import contextlib
import grpc

from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvTransferHeader
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.serve.auth import token_metadata
from dualpace.serve.peer_channels import TRANSFER_TIMEOUT_S, PeerChannels
from dualpace.serve.security import TlsConfig, peer_channel
from dualpace.serve.server import channel_options
from dualpace.wire.engine_messages import kv_header_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc


class KvControlSender:
    """send(header, outgoing) for dualpace.engine.transfer.migration.migrate_out, over one ImportKv stream.

    Whatever ends the import before the commit (the target rejects the KV, the link
    drops) raises Unavailable with the target's status in its message, so MigrateOut
    fails with one code however the failure was noticed."""

    def __init__(self, target_address: str, faults: FaultConfig | None = None, timeout_s: float = TRANSFER_TIMEOUT_S,
                 auth_token: str | None = None, tls: TlsConfig | None = None, channels: PeerChannels | None = None):
        self.target_address = target_address
        # Channels kept open across transfers (dualpace.serve.peer_channels): a 1-token transfer took
        # 8.5 / 11.3 ms on a kept channel against 12.9 / 14.6 ms on a fresh one.
        # None: a channel of its own per transfer, closed after it.
        self.channels = channels
        self.faults = faults or FaultConfig()
        self.timeout_s = timeout_s
        self.auth_token = auth_token  # the shared --auth-token-file token the target requires, if any
        self.tls = tls  # this daemon's TLS settings: a TLS engine reaches its TCP peers over TLS

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

    async def __call__(self, header: KvTransferHeader, outgoing: OutgoingKv) -> str:
        """A move without KV (the target recomputes the request): the header, prepare, commit."""
        if header.num_computed_tokens > 0:
            raise Unavailable(f"KV to {self.target_address}: {header.num_computed_tokens} tokens of KV need "
                              "shared memory or the data socket, and this transfer has neither")
        async with self._channel() as channel:
            call = self._open_import(channel)
            try:
                await self._write(call, kv_header_to_pb(header), "the header")
                return await self._prepare_and_commit(call)
            except BaseException:
                call.cancel()  # the target drops the partial import
                raise

    def _open_import(self, channel):
        return engine_pb2_grpc.EngineStub(channel).ImportKv(timeout=self.timeout_s,
                                                             metadata=token_metadata(self.auth_token))

    async def _prepare_and_commit(self, call) -> str:
        """The second phase; returns the target engine's name once it has committed."""
        await self._write(call, engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()), "prepare")
        await self._expect(call, "prepared")
        await self._write(call, engine_pb2.ImportKvMessage(commit=engine_pb2.ImportKvCommit()), "commit")
        committed = await self._expect(call, "committed")
        await call.done_writing()
        return committed.engine

    @staticmethod
    async def _write(call, message: engine_pb2.ImportKvMessage, what: str, *more: engine_pb2.ImportKvMessage) -> None:
        """`more`: messages sent with it in one send (a watch's import call only: kv_shm_control)."""
        try:
            await call.write(message, *more)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            # The target already ended the stream (e.g. it rejected the header): whether
            # the write notices that is a race, so report it like an early end of the replies.
            raise await _ended(call, f"while sending {what}") from None

    @staticmethod
    async def _expect(call, kind: str):
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError:  # the target ended the stream with an error status
            raise await _ended(call, f"before '{kind}'") from None
        if reply is grpc.aio.EOF:
            # The target ended the stream: its status says why (e.g. a corrupt layer).
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
