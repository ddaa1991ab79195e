"""The dualpace.v1.Engine servicer, shared by gpu_service and cpu_service.

Thin: convert at the wire boundary, call the EngineLoop, convert back. Errors are
raised as dualpace.errors exceptions; the server's interceptor maps them to
status codes. A Generate stream ends with UNAVAILABLE when the engine failed
(its forward pass raised) and with DATA_LOSS when only its request failed
(non-finite logits); tokens produced before either are sent first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time

from dualpace.engine.transfer.kv_shm_import import ShmImport, import_messages
from dualpace.engine.transfer.kv_shm_protocol import ShmDeclined, ShmReservation
from dualpace.engine.transfer.shm_control import IncomingStream
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.host_tier_import import HostTierImporter
from dualpace.engine.transfer.kv_transfer import PrefixCopy
from dualpace.engine.transfer.migration import KvImporter, migrate_out
from dualpace.engine.transfer.prefix_copy import send_cached_prefix
from dualpace.errors import DataLoss, InvalidArgument, RequestNotFound, Unavailable
from dualpace.faults import FaultConfig
from dualpace.serve.kv_events_stream import watch_kv_events
from dualpace.engine.transfer.kv_tcp_import import TcpImport
from dualpace.serve.kv_shm_transport import SameHostKv, SameHostKvSender
from dualpace.serve.kv_tcp_transport import TcpKvSender
from dualpace.serve.logging_setup import (
    bind_request_id,
    get_logger,
    request_id_from_context,
    unbind_request_id,
)
from dualpace.serve.orphan_lease import DEFAULT_ORPHAN_TIMEOUT_S, OrphanLeases
from dualpace.serve.peer_channels import PeerChannels
from dualpace.serve.peers import PeerList
from dualpace.serve.security import TlsConfig
from dualpace.serve.status import status_for
from dualpace.wire import engine_messages as messages
from dualpace.wire import kv_shm_messages as shm_messages
from dualpace.wire import kv_tcp_messages as tcp_messages
from dualpace.wire.kv_events import kv_event_batch_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc

MIN_WATCH_INTERVAL_MS = 20
DEFAULT_WATCH_INTERVAL_MS = 200
COPY_PIN_PREFIX = "copy-prefix:"  # table ids of the blocks a CopyPrefix pins while it reads them

log = get_logger(__name__)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, loop: EngineLoop, faults: FaultConfig | None = None, auth_token: str | None = None,
                 orphan_timeout_s: float = DEFAULT_ORPHAN_TIMEOUT_S, same_host: SameHostKv | None = None,
                 peers: PeerList | None = None, tls: TlsConfig | None = None,
                 channels: PeerChannels | None = None):
        self.loop = loop
        self.same_host = same_host  # KV through shared memory with daemons on this host (None: no shared memory)
        self.peers = peers or PeerList()  # MigrateOut targets allowed (--peer); none by default
        self.leases = OrphanLeases(loop, orphan_timeout_s)  # keep-running requests nobody reads
        self.faults = faults or FaultConfig()
        self.auth_token = auth_token  # sent on this engine's own calls (KV migration to the target)
        self.tls = tls  # this daemon's TLS: its migrations to TCP peers go over TLS too
        # The daemon's channels to its peers, kept open across transfers (it closes them at shutdown);
        # with same_host, the same object as same_host.channels. None: a channel per transfer.
        self.channels = channels
        self._next_copy = 0  # CopyPrefix calls so far (their pins' table ids)
        if same_host is not None and same_host.pool.server is not None:
            same_host.pool.server.stream_handler = self.import_over_watch  # same-host imports without gRPC

    async def Generate(self, request, context):
        loop = self.loop
        kind = request.WhichOneof("kind")
        # The caller's x-request-id (the router's), else the request's own id.
        bind_request_id(request_id_from_context(context) or _generate_request_id(request, kind))
        if kind == "new_request":
            request_id, prompt_token_ids, params = messages.new_request_from_pb(request.new_request)
            options = messages.new_request_options_from_pb(request.new_request)
            log.info("generate", prompt_tokens=len(prompt_token_ids), max_tokens=params.max_tokens)
            channel = await loop.add_request(request_id, prompt_token_ids, params, options.num_prior_output_tokens,
                                             options.hold_after_first_token)
            start = 0
            abort_on_disconnect = not options.keep_running_on_disconnect
        elif kind == "resume":
            request_id = request.resume.request_id
            channel = loop.channel(request_id)
            start = request.resume.from_token_index
            abort_on_disconnect = False  # whoever resumes (the router) aborts explicitly
            if start > len(channel.output_token_ids):
                raise InvalidArgument("resume.from_token_index",
                                      f"{start} is past the {len(channel.output_token_ids)} tokens generated so far")
            log.info("generate resumed", from_token_index=start)
        else:
            raise InvalidArgument("kind", "set new_request or resume")
        name = loop.core.config.name
        finished = False
        self.leases.attach(request_id)
        try:
            async for update in channel.follow(start):
                if update.error_message is not None:
                    if update.new_token_ids:  # tokens made before the error reach the client first
                        yield messages.generate_response_to_pb(
                            request_id, dataclasses.replace(update, finish_reason=None), name,
                            channel.num_prompt_tokens, len(channel.output_token_ids), channel.num_cached_tokens)
                    finished = True
                    if update.engine_failed:
                        raise Unavailable(update.error_message)
                    raise DataLoss(update.error_message)
                yield messages.generate_response_to_pb(
                    request_id, update, name, channel.num_prompt_tokens, len(channel.output_token_ids),
                    channel.num_cached_tokens)
            finished = True
        finally:
            if abort_on_disconnect and not finished and not channel.done:
                # The client went away: the request must not keep its KV blocks.
                log.info("client went away; aborting")
                await _abort_quietly(loop, request_id)
            self.leases.detach(request_id, left_running=not abort_on_disconnect and not finished and not channel.done)
            log.debug("generate stream ended", output_tokens=len(channel.output_token_ids), finished=finished)
            unbind_request_id()

    async def Abort(self, request, context):
        bind_request_id(request_id_from_context(context) or request.request_id)
        log.info("abort")
        await self.loop.abort(request.request_id)
        return engine_pb2.AbortResponse(found=True)

    async def MigrateOut(self, request, context):
        if not request.target_address:
            raise InvalidArgument("target_address", "must be set")
        bind_request_id(request_id_from_context(context) or request.request_id)
        self.peers.check(request.target_address)  # before anything is paused or sent
        log.info("migrate out", target=request.target_address)
        # The stream's migrated_to is the target's address: where the client resumes the request.
        sender = self._sender(request.target_address)
        stats = await migrate_out(self.loop, request.request_id, sender, migrated_to=request.target_address)
        return messages.migrate_out_response_to_pb(stats, data_path(sender))

    def _sender(self, target_address: str) -> TcpKvSender:
        """This engine's KV sender to another: shared memory or the data socket (the data socket alone:
        in-process servicers without a same-host side)."""
        if self.same_host is not None:
            return self.same_host.sender(target_address, self.faults, self.auth_token, self.tls)
        return TcpKvSender(target_address, faults=self.faults, auth_token=self.auth_token, tls=self.tls,
                           channels=self.channels)

    async def ImportKv(self, request_iterator, context):
        importer = KvImporter(self.loop)
        shm = self.same_host.importer_side(importer) if self.same_host is not None else None
        tcp: TcpImport | None = None  # the data-socket side, made when the header offers it
        started = time.perf_counter()
        marks = importer.marks  # (event, perf_counter s): this process's clock, the sender's too on one host
        marks.append(("stream_start", started))
        try:
            async for message in import_messages(request_iterator, importer):
                kind = message.WhichOneof("kind")
                marks.append((f"{kind}_read", time.perf_counter()))
                if kind == "shm_reserve_ahead":  # blocks for a transfer to come, its header later
                    if importer.progress is not None or importer.reserved_ahead:
                        raise InvalidArgument("shm_reserve_ahead", "only as an import's first message")
                    if shm is None:
                        raise InvalidArgument("shm_reserve_ahead", "this engine has no shared KV pool")
                    ahead = shm_messages.shm_reserve_ahead_from_pb(message.shm_reserve_ahead)
                    await importer.reserve_ahead(ahead.layout, ahead.num_tokens)
                    answer = shm.answer(ahead.offer)
                    if isinstance(answer, ShmDeclined):
                        raise InvalidArgument("shm_reserve_ahead.shm_offer", answer.reason)
                    yield shm_messages.shm_answer_to_pb(answer)
                    continue
                if kind == "header":
                    if importer.progress is not None:
                        raise InvalidArgument("header", "sent twice")
                    header = messages.kv_header_from_pb(message.header)
                    if importer.reserved_ahead:  # its blocks adopted, no answer: written + commit follow
                        if header.cache_only:
                            raise InvalidArgument("header.cache_only", "not into blocks reserved ahead")
                        await importer.begin(header)
                        marks.append(("reserved", time.perf_counter()))
                        continue
                    if header.cache_only:  # host-tier blocks for this engine's prefix cache
                        importer = HostTierImporter(self.loop)
                        if shm is not None:
                            await shm.close()
                            shm = None
                    await importer.begin(header)
                    marks.append(("reserved", time.perf_counter()))
                    if header.cache_only and header.skip_cached:  # say what is held here: the rest follows
                        yield messages.cache_held_to_pb(importer.num_held_tokens)
                    offer = shm_messages.shm_offer_from_pb(message.header)
                    answer = None
                    if offer is not None:
                        answer = shm.answer(offer) if shm is not None else ShmDeclined("the target has no shared KV pool")
                    if tcp_messages.has_tcp_offer(message.header) and not isinstance(answer, ShmReservation):
                        tcp = self._tcp_side(importer)  # shared memory declined (another host) or not offered
                        yield tcp_messages.tcp_answer_to_pb(tcp.answer())
                        marks.append(("answer_written", time.perf_counter()))
                    elif answer is not None:
                        yield shm_messages.shm_answer_to_pb(answer)
                        marks.append(("answer_written", time.perf_counter()))
                elif kind == "tcp_written":
                    if tcp is None:
                        raise InvalidArgument("tcp_written", "no data-socket reservation was made for this import")
                    written = tcp_messages.tcp_written_from_pb(message.tcp_written)
                    await tcp.written(written)
                    marks.append(("verified", time.perf_counter()))
                    if written.commit:
                        yield await self._commit_import(importer)
                        _log_import(importer, started)
                        return
                elif kind == "shm_written":
                    if shm is None or importer.progress is None:
                        raise InvalidArgument("shm_written", "before a header, or this engine has no shared KV pool")
                    written = shm_messages.shm_written_from_pb(message.shm_written)
                    await shm.written(written)
                    marks.append(("verified", time.perf_counter()))
                    if written.commit:  # prepare and commit in the same message (commit prepares first)
                        yield await self._commit_import(importer)
                        _log_import(importer, started)  # once the reply is on its way
                        return
                elif kind == "prepare":
                    progress = await importer.prepare()
                    num_kv_blocks = len(self.loop.core.scheduler.blocks.block_ids(progress.header.request_id))
                    yield messages.import_prepared_to_pb(progress, num_kv_blocks)
                elif kind == "commit":
                    yield await self._commit_import(importer)
                    _log_import(importer, started)
                    return
                else:
                    raise InvalidArgument("kind", "empty ImportKv message")
        finally:
            # The commit did not wake the engine's loop (_commit_import): it is woken here, once the
            # reply is sent or the stream ended, so that an idle engine's first step for the request
            # does not hold up the reply the source waits for (1-2 ms measured). The CPU is yielded first:
            # a kernel that packs waking threads onto busy CPUs (a 2-vCPU guest does) may have put the
            # source, woken by that reply, behind this thread, and the step would then run before the
            # source reads it (the committed reply read 2.2 ms late on a 16-token transfer). Elsewhere
            # the yield returns at once.
            os.sched_yield()
            self.loop.wake()
            # Shielded as one: the blocks are freed only after any shared-memory write has stopped.
            await asyncio.shield(_end_import(shm, importer, tcp))

    async def import_over_watch(self, stream: IncomingStream) -> None:
        """ImportKv over a sender's watch connection (dualpace.engine.transfer.shm_control): the same handler,
        its status sent as the stream's end. Cancelled when the sender abandons the stream or the
        connection ends: ImportKv's cleanup then drops the import, as for a cancelled RPC."""
        requests = (engine_pb2.ImportKvMessage.FromString(payload) async for payload in stream.messages())
        try:
            async with contextlib.aclosing(self.ImportKv(requests, None)) as replies:
                async for reply in replies:
                    await stream.reply(reply.SerializeToString())
            await stream.end(0)
        except (OSError, ConnectionError):
            pass  # the connection broke: its end cancels nothing more here (the import was dropped)
        except Exception as exc:  # noqa: BLE001 - every error becomes the stream's status, as over gRPC
            code, message = status_for(exc)
            log.debug("kv import over the watch ended", code=code.name, details=message)
            with contextlib.suppress(OSError, ConnectionError):
                await stream.end(code.value[0], message)

    def _tcp_side(self, importer: KvImporter) -> TcpImport:
        if self.same_host is None:
            return TcpImport(None, importer)
        return self.same_host.tcp_side(importer)

    async def _commit_import(self, importer: KvImporter) -> engine_pb2.ImportKvReply:
        engine_name = await importer.commit(wake_loop=False)
        importer.marks.append(("committed", time.perf_counter()))
        if not importer.progress.header.cache_only:
            self.leases.start(importer.progress.header.request_id)  # until the router resumes it here
        return messages.import_committed_to_pb(importer.progress.header.request_id, engine_name)

    async def CopyPrefix(self, request, context):
        token_ids, target = messages.copy_prefix_request_from_pb(request)
        self.peers.check(target)  # before anything is pinned or sent
        started = time.perf_counter()
        sender = self._sender(target)
        self._next_copy += 1
        pin_id = f"{COPY_PIN_PREFIX}{self._next_copy}"
        copy = await send_cached_prefix(self.loop, sender.send_cache, token_ids, pin_id)
        if copy is None:
            copy = PrefixCopy(0, 0, "")
        log.info("copied prefix", target=target, tokens=copy.num_tokens, sent_tokens=copy.num_sent_tokens)
        return messages.copy_prefix_response_to_pb(copy, (time.perf_counter() - started) * 1e3)

    async def GetLoad(self, request, context):
        return messages.load_to_pb(self.loop.load())

    async def WatchLoad(self, request, context):
        interval_ms = max(request.interval_ms or DEFAULT_WATCH_INTERVAL_MS, MIN_WATCH_INTERVAL_MS)
        while not self.loop.stopped.is_set():  # ends when the engine stops, so shutdown need not wait for it
            yield messages.load_to_pb(self.loop.load())
            await asyncio.sleep(interval_ms / 1e3)

    async def ListRequests(self, request, context):
        scheduler = self.loop.core.scheduler
        blocks = scheduler.blocks
        infos = [
            messages.request_info_to_pb(r, blocks.num_held_blocks(r.request_id) if blocks.has(r.request_id) else 0)
            for r in list(scheduler.requests.values())
        ]
        return engine_pb2.ListRequestsResponse(requests=infos)

    async def Info(self, request, context):
        return messages.engine_info_to_pb(self.loop.core)

    async def WatchKvEvents(self, request, context):
        name = self.loop.core.config.name
        async for events in watch_kv_events(self.loop):
            yield kv_event_batch_to_pb(events, name)


def _log_import(importer: KvImporter, started: float) -> None:
    """The import's debug line (its marks: where the time went), written after the committed reply
    left (at DEBUG it took ~0.1-0.3 ms before the reply, on the transfer's path). Nothing below DEBUG:
    building its arguments for a line dropped later cost 0.16 ms cold, while the source waits (it
    runs before the CPU is yielded to it)."""
    if not logging.getLogger(__name__).isEnabledFor(logging.DEBUG):  # structlog's own logger may lack it
        return
    marks = importer.marks
    committed_at = next((t for name, t in reversed(marks) if name == "committed"), time.perf_counter())
    commit_from = next((t for name, t in reversed(marks) if name in ("verified", "commit_read")), committed_at)
    log.debug("kv import", request_id=importer.progress.header.request_id,
              marks_s=[(name, round(t, 6)) for name, t in marks],
              bytes=importer.progress.num_bytes,
              commit_ms=round((committed_at - commit_from) * 1e3, 2),
              total_ms=round((committed_at - started) * 1e3, 2))


def data_path(sender: TcpKvSender) -> str:
    """The path the last transfer's KV took: "shm", "tcp", or "none" (a request moved without KV)."""
    if isinstance(sender, SameHostKvSender) and sender.used_shm:
        return "shm"
    return "tcp" if sender.used_tcp else "none"


async def _end_import(shm: ShmImport | None, importer: KvImporter, tcp: TcpImport | None = None) -> None:
    if shm is not None:
        await shm.close()
    if tcp is not None:
        await tcp.close()
    await importer.cancel()


def _generate_request_id(request, kind: str | None) -> str | None:
    if kind == "new_request":
        return request.new_request.request_id or None
    if kind == "resume":
        return request.resume.request_id or None
    return None


async def _abort_quietly(loop: EngineLoop, request_id: str) -> None:
    try:
        await loop.abort(request_id)
    except (RequestNotFound, Unavailable):
        pass  # already finished, moved, or the engine is stopping
