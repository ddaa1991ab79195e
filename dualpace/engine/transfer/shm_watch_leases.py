"""Write leases over the watch connection a sender keeps to a target's pool (the sender's side).

A sender that maps a target's KV pool keeps the connection that fetched the memfd open as its
"watch" (its end says the owner died). The same connection carries the write leases of every
transfer into that pool, so a transfer opens no connection of its own (before, each one
connected to the owner's socket from a worker thread: a thread hop plus a connect and an
accept, about 0.6 ms of a 64-token transfer on a loaded machine). The rules of a lease are
those of dualpace.engine.transfer.same_host, unchanged:

- the sender asks for a job's lease (`L` + ticket) and writes only once granted (`OK` + ticket);
  a job the owner revoked first is refused (`NO` + ticket) and nothing is written; a lease granted
  to an ask ahead that the owner revokes before the sender held it is refused afterwards too, and
  the sender then ends it at once (blocks reserved ahead that the target takes back);
- the lease ends when the sender says so (`E` + ticket), after its copy has stopped, or when the
  connection ends (the sender died, or dropped the mapping once no copy used it); the owner
  frees a failed job's memory only after that.

A lease may be asked for ahead (`ask`: `A` + a ticket of the sender's own, before the job exists)
and then held with `held(ticket)`, which awaits that answer instead of asking again; an ask
that is never held is ended with `withdraw`. An ask, and a lease's end, leave with the next record
sent (an import's header right after the ask; its `written` right after the end), in one send, or
at the event loop's next turn: one wake-up of the owner for both (sent apart, the owner woke on the
first and the sender's next send waited behind it: 0.1-0.7 ms between a 16-token copy's lease end
and its `written` on a 2-vCPU guest, where the owner is woken onto the sender's vCPU).

The same connection carries control streams too (dualpace.engine.transfer.shm_control: a transfer's
import messages without gRPC). Everything here runs on the event loop's thread. Lease messages
are fixed-size: requests `same_host.REQUEST_BYTES`, answers `same_host.ANSWER_BYTES`; stream
records carry their length.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from dualpace.engine.transfer.same_host import (
    ANSWER_BYTES,
    GRANTED,
    KIND_ASK,
    KIND_END,
    KIND_LEASE,
    REFUSED,
    SameHostRefused,
    new_ticket,
)
from dualpace.engine.transfer.shm_control import CODE_UNAVAILABLE, REPLY, BadRecord, OutgoingStream, split_record

_VERDICTS = {GRANTED: ANSWER_BYTES, REFUSED: ANSWER_BYTES}


class WatchLeases:
    """The sender's end of one watch connection, read by the event loop (add_reader is the owner's:
    MappedPools calls `readable()` from its reader and drops the mapping when it returns False)."""

    def __init__(self, watch: socket.socket):
        self.watch = watch
        self._answers: dict[bytes, asyncio.Future] = {}  # ticket -> the owner's answer (True: granted)
        self._received = b""
        self._pending = b""  # bytes the socket did not take yet (it is non-blocking)
        self._writer_added = False
        self._streams: dict[bytes, OutgoingStream] = {}  # control streams under way, by stream id
        self._asked: dict[bytes, asyncio.Future] = {}  # asked ahead (ask), not held yet: ticket -> answer
        self._ahead = b""  # asks and ends not sent yet: they go with the next record (or at the loop's next turn)
        self.closed = False

    def readable(self) -> bool:
        """Read what the owner sent; False once the connection ended (every waiting lease refused)."""
        try:
            data = self.watch.recv(4096)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self._refuse_waiting("the owner closed the connection")
            return False
        self._received += data
        while True:
            try:
                record, size = split_record(self._received, len(GRANTED), _VERDICTS)
            except BadRecord:
                self._refuse_waiting("the owner sent something else")
                return False
            if record is None:
                return True
            self._received = self._received[size:]
            kind, ticket, code, body = record
            if kind in _VERDICTS:
                waiting = self._answers.pop(ticket, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(kind == GRANTED)
                elif kind == REFUSED and ticket in self._asked:
                    self.withdraw(ticket)  # granted ahead, not held yet, and revoked by the owner: ended now
            elif (stream := self._streams.get(ticket)) is not None:
                if kind == REPLY:
                    stream.deliver(body)
                else:
                    stream._ended(code, body.decode("utf-8", "replace"))

    def open_stream(self) -> OutgoingStream:
        """A new control stream to the owner (dualpace.engine.transfer.shm_control)."""
        if self.closed:
            raise SameHostRefused("the watch connection was closed")
        stream = OutgoingStream(new_ticket(), self._send_or_end, self._streams.pop)
        self._streams[stream.stream_id] = stream
        return stream

    def _send_or_end(self, data: bytes) -> None:
        """A stream's record; a broken connection ends every stream (the owner sees the end too)."""
        try:
            self._send(data)
        except SameHostRefused as exc:
            self._refuse_waiting(str(exc))
            raise

    def ask(self, ticket: bytes) -> None:
        """Ask now for the lease of the job the owner will open under `ticket` (ours); `held(ticket)`
        takes the answer, or `withdraw(ticket)` ends the ask. Raises SameHostRefused (nothing asked)."""
        if self.closed:
            raise SameHostRefused("the watch connection was closed")
        if ticket in self._answers:
            raise SameHostRefused("a lease for that job is already asked for")
        self._answers[ticket] = self._asked[ticket] = asyncio.get_running_loop().create_future()
        self._send_soon(KIND_ASK + ticket)

    def _send_soon(self, record: bytes) -> None:
        """Send `record` with the next record sent, or at the event loop's next turn (in order)."""
        if not self._ahead:
            asyncio.get_running_loop().call_soon(self._send_ahead)
        self._ahead += record

    def _send_ahead(self) -> None:
        if self._ahead and not self.closed:
            try:
                self._send(b"")  # the asks, if no record took them along
            except SameHostRefused as exc:
                self._refuse_waiting(str(exc))

    def withdraw(self, ticket: bytes) -> None:
        """End an ask that was not held (no job came, or it got another ticket); else nothing."""
        answer = self._asked.pop(ticket, None)
        if answer is None:
            return
        self._answers.pop(ticket, None)
        if answer.done() and not answer.cancelled():
            answer.exception()  # retrieved: a refusal nobody awaits is no error
        answer.cancel()
        self._end(ticket)  # granted or still waiting for its job: the owner ends or drops it

    @contextlib.asynccontextmanager
    async def held(self, ticket: bytes):
        """The job's lease, held while the body writes; its end is sent when the body is done (also
        when it fails or is cancelled: the body must have stopped writing by then). Asked for now,
        or ahead (`ask`)."""
        if self.closed:
            raise SameHostRefused("the watch connection was closed")
        answer = self._asked.pop(ticket, None)
        if answer is None and ticket in self._answers:
            raise SameHostRefused("a lease for that job is already asked for")
        try:
            if answer is None:
                answer = self._answers[ticket] = asyncio.get_running_loop().create_future()
                self._send(KIND_LEASE + ticket)
            granted = await answer
        except BaseException:
            # Asked but not answered (cancelled, or the connection broke): the owner may have granted
            # it, so end it; an end for a job never granted is ignored by the owner.
            self._answers.pop(ticket, None)
            self._end(ticket)
            raise
        if not granted:
            raise SameHostRefused("the owner refused the lease (the job was cancelled)")
        try:
            yield
        finally:
            self._end(ticket)

    def close(self) -> None:
        """Stop using the connection (the caller removed it from the event loop and closes it)."""
        self.closed = True
        self._refuse_waiting("the mapping was dropped")
        if self._writer_added:
            asyncio.get_running_loop().remove_writer(self.watch.fileno())
            self._writer_added = False

    def _end(self, ticket: bytes) -> None:
        """The lease's end, sent with the next record (a copy's `written`) or at the loop's next turn;
        the copy has stopped by now, so its end may wait that long (it only delays the owner's freeing
        of a failed job's blocks). A broken connection: the owner sees its end, which ends the lease."""
        if self.closed:
            return  # the connection's end (the caller closes it once no copy uses it) ends the lease
        self._send_soon(KIND_END + ticket)

    def _refuse_waiting(self, why: str) -> None:
        waiting, self._answers = self._answers, {}
        for answer in waiting.values():
            if not answer.done():
                answer.set_exception(SameHostRefused(f"no lease: {why}"))
        for stream in list(self._streams.values()):
            stream._ended(CODE_UNAVAILABLE, f"the watch connection ended: {why}")

    def _send(self, data: bytes) -> None:
        """Send in order (asks ahead first); what the socket cannot take now is sent when it can (never
        dropped)."""
        if self._ahead:
            data, self._ahead = self._ahead + data, b""
        if self._pending:
            self._pending += data
            return
        try:
            sent = self.watch.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:  # the connection broke: the owner sees its end, which ends every lease
            raise SameHostRefused(f"watch connection broken: {exc}") from exc
        if sent < len(data):
            self._pending = data[sent:]
            asyncio.get_running_loop().add_writer(self.watch.fileno(), self._flush)
            self._writer_added = True

    def _flush(self) -> None:
        try:
            sent = self.watch.send(self._pending)
        except BlockingIOError:
            return
        except OSError:
            sent = len(self._pending)  # broken: the owner sees the connection's end instead
        self._pending = self._pending[sent:]
        if not self._pending:
            asyncio.get_running_loop().remove_writer(self.watch.fileno())
            self._writer_added = False
