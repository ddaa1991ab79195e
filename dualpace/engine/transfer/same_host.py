"""Same-host proof and shared-memory hand-over between two daemons (Linux).

Two daemons may move bytes through shared memory only when they share a kernel and the
segment one of them names is the one the other maps. The proof has two parts:

- equal boot ids (/proc/sys/kernel/random/boot_id): the same running kernel;
- the segment itself: its owner passes a memfd over a Unix socket in the abstract
  namespace (so it is in the same network namespace and nothing is ever written to the
  filesystem), only to a caller of the same user that presents the ticket the owner gave
  it over the authenticated control plane; the caller then checks the random token the
  owner wrote into the segment's header (dualpace.engine.transfer.shm_segment).

Nothing outlives a SIGKILLed daemon: a memfd has no name, an abstract socket goes with
its process, and a caller that holds a mapping keeps a "watch" connection whose end tells
it that the owner died, so it drops the mapping (and the memory goes back to the kernel).

`TicketServer` also grants leases: a caller that is about to write into the owner's memory
takes one for that job, and the owner frees what the job wrote into only once the lease
has ended (the caller closed it, or died), so a late write never lands in memory that was
handed to someone else. A lease is taken either on a connection of its own, or (where the
owner offers it, `lease_on_watch`) over the caller's watch connection, which then carries the
leases of all its jobs with the same rules (dualpace.engine.transfer.shm_watch_leases): no connection,
no thread, per job. Used by the KV transfer; meant for the Dense Assist rings too.

On a watch connection a caller may also ask for a lease *ahead* (`A` + a ticket of its own
choosing), before the job exists: the owner holds the request until a job is opened under
that ticket (`open_lease(ticket)`), then grants it as if it had just been asked for (refused:
the job was revoked first). So the request's round trip overlaps whatever makes the job (the
KV import's reservation), and the caller still asks for and ends every lease it holds: an ask
it no longer wants (no job came, or the job got another ticket) it ends with `E` like a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dualpace.engine.transfer.shm_control import (
    CODE_UNAVAILABLE,
    KIND_ABANDON,
    KIND_MESSAGE,
    BadRecord,
    IncomingStream,
    WatchSender,
    ended_record,
    split_record,
)
from dualpace.errors import Unavailable

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
TICKET_BYTES = 16
REQUEST_BYTES = 1 + TICKET_BYTES  # kind + ticket
KIND_FD = b"F"  # hand me the memfd behind this ticket (and keep this connection as the watch)
KIND_LEASE = b"L"  # I am about to write for the job behind this ticket
KIND_END = b"E"  # on a watch connection: I stopped writing for the job behind this ticket
KIND_ASK = b"A"  # on a watch connection: I will write for the job to be opened under this ticket of mine
GRANTED, REFUSED = b"OK", b"NO"
ANSWER_BYTES = len(GRANTED) + TICKET_BYTES  # on a watch connection: the verdict, then the ticket it answers
HANDSHAKE_TIMEOUT_S = 5.0
ACCEPT_RETRY_S = 0.1  # after a failed accept


async def accept_forever(listener: socket.socket, serve: Callable[[socket.socket], Awaitable[None]],
                         tasks: set[asyncio.Task], what: str) -> None:
    """Accepts connections on a non-blocking listener until cancelled, each served by its own task
    (kept in `tasks` while it runs). A failed accept (a full file table, say) is logged and retried
    a little later: the listener stays, and later peers are still served."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            connection, _ = await loop.sock_accept(listener)
        except OSError as exc:
            log.warning("%s: accept failed: %s", what, exc)
            await asyncio.sleep(ACCEPT_RETRY_S)
            continue
        task = asyncio.create_task(serve(connection))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


@functools.cache
def boot_id() -> str | None:
    """This kernel's boot id, or None where it cannot be read (then nothing is shared). Read once per
    process (a process's kernel does not change): every same-host transfer offers it, and reading
    /proc cost 0.1 ms of a 16-token transfer's fixed cost."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as file:
            return file.read().strip() or None
    except OSError:
        return None


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def _peer_uid(connection: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return uid


@dataclass
class Lease:
    """One job's right to write into the owner's memory."""

    granted: bool = False
    revoked: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_ended(self) -> None:
        """Returns once no write for this job can happen any more (never granted, or closed)."""
        if self.granted:
            await self.ended.wait()


class TicketServer:
    """The owner's side: an abstract Unix socket that hands out fds and leases to ticket holders."""

    def __init__(self, purpose: str):
        self.name = f"dualpace-{purpose}-{os.getpid()}-{secrets.token_hex(8)}"
        self._fds: dict[bytes, int] = {}
        self._leases: dict[bytes, Lease] = {}
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        # Runs one control stream over a watch connection (dualpace.engine.transfer.shm_control); None: none taken.
        self.stream_handler: Callable[[IncomingStream], Awaitable[None]] | None = None
        self._finished_streams: set[bytes] = set()  # random ids: a late message starts nothing
        # Leases asked for ahead (KIND_ASK) of their job: ticket -> (that watch's granted leases, its sender).
        self._asked: dict[bytes, tuple[dict[bytes, Lease], WatchSender]] = {}
        self._granted_ahead: dict[bytes, WatchSender] = {}  # leases granted to an ask ahead, until revoked
        self._revoked: set[bytes] = set()  # an ask ahead for one of these is refused (bounded)

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self.name)
        listener.listen(64)
        listener.setblocking(False)
        self._socket = listener
        self._task = asyncio.create_task(self._accept_loop())

    async def close(self) -> None:
        for task in [self._task, *self._connections]:
            if task is not None:
                task.cancel()
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def share_fd(self, fd: int, ticket: bytes | None = None) -> bytes:
        """A ticket (`ticket`, or a new one) that gets `fd` for whoever presents it."""
        ticket = ticket or new_ticket()
        self._fds[ticket] = fd
        return ticket

    def open_lease(self, ticket: bytes | None = None) -> tuple[bytes, Lease]:
        """A ticket for one job (the caller's own `ticket` where it is new here, else a new one); the
        job may write once a caller holds its lease. A lease asked for ahead under it is granted now."""
        if ticket is None or len(ticket) != TICKET_BYTES or ticket in self._leases or ticket in self._revoked:
            ticket = new_ticket()
        lease = self._leases[ticket] = Lease()
        asked = self._asked.pop(ticket, None)
        if asked is not None:
            granted, sender = asked
            lease.granted = True  # no await since the job was opened: a revoke cannot slip in between
            granted[ticket] = lease  # ends with that connection, as any lease granted over it
            sender.send_soon(GRANTED + ticket)  # with the reservation's reply, in one send
            self._granted_ahead[ticket] = sender
        return ticket, lease

    def revoke(self, ticket: bytes) -> Lease | None:
        """No new lease for this job from now on; returns it (wait_ended() before freeing its memory)."""
        lease = self._leases.pop(ticket, None)
        sender = self._granted_ahead.pop(ticket, None)
        if lease is not None:
            lease.revoked = True
            if len(self._revoked) >= 4096:
                self._revoked.clear()
            self._revoked.add(ticket)
            if sender is not None and not lease.ended.is_set():
                # Granted ahead and not ended: a sender that has not started its copy (blocks reserved
                # ahead, waiting for a transfer) ends the lease at once on this, instead of keeping it.
                sender.send_soon(REFUSED + ticket)
        return lease

    def _grant(self, ticket: bytes) -> Lease | None:
        """The job's lease, now granted; None if there is no such job, it was revoked, or granted
        already. No await between the check and the grant: a revoke cannot slip in between."""
        lease = self._leases.get(ticket)
        if lease is None or lease.revoked or lease.granted:
            return None
        lease.granted = True
        return lease

    async def _serve_watch(self, loop: asyncio.AbstractEventLoop, connection: socket.socket) -> None:
        """The fd's caller keeps this connection as its watch, and asks for the write leases of its
        jobs over it (dualpace.engine.transfer.shm_watch_leases): `L` + ticket, answered with the verdict and
        the ticket; `E` + ticket ends that lease. Every lease granted here ends with the connection.
        Control streams (dualpace.engine.transfer.shm_control) go to `stream_handler`, one task each; they
        are cancelled when the connection ends (their imports then wait for the leases' end)."""
        granted: dict[bytes, Lease] = {}
        asked: set[bytes] = set()  # this connection's asks ahead (KIND_ASK) that may still wait for a job
        streams: dict[bytes, IncomingStream] = {}
        sender = WatchSender(loop, connection)
        send = sender.send

        received = b""
        fixed = {KIND_LEASE: REQUEST_BYTES, KIND_END: REQUEST_BYTES, KIND_ABANDON: REQUEST_BYTES,
                 KIND_ASK: REQUEST_BYTES}
        try:
            while data := await loop.sock_recv(connection, 65536):
                received += data
                while True:
                    try:
                        record, size = split_record(received, 1, fixed)
                    except BadRecord:
                        return  # not this protocol: end the connection (and its leases and streams)
                    if record is None:
                        break
                    received = received[size:]
                    kind, ticket, _, body = record
                    if kind == KIND_ASK and ticket not in self._leases and ticket not in self._revoked:
                        if ticket in self._asked:  # asked twice: refused (the first ask still waits)
                            await send(REFUSED + ticket)
                        else:  # no job yet: open_lease(ticket) grants it
                            self._asked[ticket] = (granted, sender)
                            asked.add(ticket)
                    elif kind in (KIND_LEASE, KIND_ASK):
                        lease = self._grant(ticket)
                        if lease is not None:
                            granted[ticket] = lease
                        await send((GRANTED if lease is not None else REFUSED) + ticket)
                    elif kind == KIND_END:
                        if (lease := granted.pop(ticket, None)) is not None:
                            lease.ended.set()
                        elif ticket in asked and self._asked.get(ticket, (None,))[0] is granted:
                            del self._asked[ticket]  # an ask ahead withdrawn before its job came
                        asked.discard(ticket)
                    elif kind == KIND_MESSAGE:
                        if not self._deliver(streams, ticket, body, send):
                            await send(ended_record(ticket, CODE_UNAVAILABLE, "no control streams here"))
                    elif kind == KIND_ABANDON and (stream := streams.pop(ticket, None)) is not None:
                        stream.task.cancel()
        finally:
            for ticket in asked:
                if self._asked.get(ticket, (None,))[0] is granted:
                    del self._asked[ticket]  # no grant may go to this connection any more
            for lease in granted.values():
                lease.ended.set()
            for stream in list(streams.values()):
                stream.task.cancel()

    def _deliver(self, streams: dict[bytes, IncomingStream], stream_id: bytes, body: bytes, send) -> bool:
        """Hand a control message to its stream, starting the stream's handler on its first one."""
        stream = streams.get(stream_id)
        if stream is None:
            if self.stream_handler is None:
                return False
            if stream_id in self._finished_streams:
                return True  # a late message of a stream that ended (its sender learns that from CX)
            stream = streams[stream_id] = IncomingStream(stream_id, send)
            stream.task = asyncio.create_task(self.stream_handler(stream))
            stream.task.add_done_callback(lambda _: self._stream_done(streams, stream_id))
        stream.deliver(body)
        return True

    def _stream_done(self, streams: dict[bytes, IncomingStream], stream_id: bytes) -> None:
        streams.pop(stream_id, None)
        if len(self._finished_streams) >= 4096:
            self._finished_streams.clear()
        self._finished_streams.add(stream_id)

    async def _accept_loop(self) -> None:
        await accept_forever(self._socket, self._serve, self._connections, "ticket socket")

    async def _serve(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        connection.setblocking(False)
        lease: Lease | None = None
        try:
            if _peer_uid(connection) not in (os.getuid(), 0):
                return
            request = await asyncio.wait_for(recv_exactly(loop, connection, REQUEST_BYTES), HANDSHAKE_TIMEOUT_S)
            kind, ticket = request[:1], request[1:]
            if kind == KIND_FD and ticket in self._fds:
                socket.send_fds(connection, [GRANTED], [self._fds[ticket]])
                await self._serve_watch(loop, connection)
                return
            if kind == KIND_LEASE and (lease := self._grant(ticket)) is not None:
                await loop.sock_sendall(connection, GRANTED)
            else:
                await loop.sock_sendall(connection, REFUSED)
                return
            while await loop.sock_recv(connection, 64):  # held until the caller closes or dies
                pass
        except (OSError, asyncio.TimeoutError, EOFError) as exc:
            log.debug("same-host connection ended: %s", exc)
        finally:
            if lease is not None:
                lease.ended.set()
            connection.close()


async def recv_exactly(loop: asyncio.AbstractEventLoop, connection: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        more = await loop.sock_recv(connection, num_bytes - len(data))
        if not more:
            raise EOFError("peer closed the connection")
        data += more
    return data


class SameHostRefused(Unavailable):
    """The owner refused or could not be reached: use the cross-host path (before the copy), or the
    transfer fails as UNAVAILABLE (a lease refused: the target dropped the import)."""


def fetch_fd(socket_name: str, ticket: bytes) -> tuple[int, socket.socket]:
    """Blocking (run it in a thread): the owner's fd, and the watch connection to keep open."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(HANDSHAKE_TIMEOUT_S)
        connection.connect("\0" + socket_name)
        connection.sendall(KIND_FD + ticket)
        message, fds, _, _ = socket.recv_fds(connection, len(GRANTED), 1)
    except OSError as exc:
        connection.close()
        raise SameHostRefused(f"cannot reach {socket_name!r}: {exc}") from exc
    if message != GRANTED or len(fds) != 1:
        connection.close()
        for fd in fds:
            os.close(fd)
        raise SameHostRefused(f"{socket_name!r} refused the ticket")
    connection.setblocking(False)
    return fds[0], connection


def _take_lease(socket_name: str, ticket: bytes) -> tuple[socket.socket, bytes]:
    """Blocking (run it in a thread, as fetch_fd): the lease connection and the owner's answer.
    Plain blocking sockets here: the event loop's sock_connect to an abstract socket name timed
    out under concurrent hand-offs (found when the data-plane branches were merged)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(HANDSHAKE_TIMEOUT_S)
        connection.connect("\0" + socket_name)
        connection.sendall(KIND_LEASE + ticket)
        answer = b""
        while len(answer) < len(GRANTED):
            more = connection.recv(len(GRANTED) - len(answer))
            if not more:
                raise EOFError("peer closed the connection")
            answer += more
    except BaseException:
        connection.close()
        raise
    return connection, answer


@contextlib.asynccontextmanager
async def held_lease(socket_name: str, ticket: bytes):
    """Hold the owner's lease for one job while the body writes; closing it tells the owner we stopped."""
    try:
        connection, answer = await asyncio.to_thread(_take_lease, socket_name, ticket)
    except (OSError, EOFError) as exc:
        raise SameHostRefused(f"no lease from {socket_name!r}: {exc}") from exc
    try:
        if answer != GRANTED:
            raise SameHostRefused(f"{socket_name!r} refused the lease (the job was cancelled)")
        yield
    finally:
        connection.close()
