"""Conversion of the same-host KV transfer messages (dualpace.engine.transfer.kv_shm_protocol) <-> protobuf."""

from __future__ import annotations

from dualpace.engine.transfer.kv_shm_protocol import ShmDeclined, ShmOffer, ShmReservation, ShmReserveAhead, ShmWritten
from dualpace.engine.transfer.kv_transfer import KvTransferHeader
from dualpace.wire.engine_messages import kv_header_to_pb, kv_layout_from_pb, kv_layout_to_pb
from dualpace.wire.v1 import engine_pb2


def kv_header_with_offer_to_pb(header: KvTransferHeader, offer: ShmOffer | None) -> engine_pb2.ImportKvMessage:
    message = kv_header_to_pb(header)
    if offer is not None:
        _set_offer(message.header.shm_offer, offer)
    return message


def _set_offer(message: engine_pb2.KvShmOffer, offer: ShmOffer) -> None:
    message.boot_id = offer.boot_id
    if offer.lease_ticket is not None:
        message.lease_ticket = offer.lease_ticket


def shm_offer_from_pb(header: engine_pb2.ImportKvHeader | engine_pb2.KvShmReserveAhead) -> ShmOffer | None:
    if not header.HasField("shm_offer"):
        return None
    return ShmOffer(header.shm_offer.boot_id, bytes(header.shm_offer.lease_ticket) or None)


def shm_reserve_ahead_to_pb(ahead: ShmReserveAhead) -> engine_pb2.ImportKvMessage:
    message = engine_pb2.ImportKvMessage(shm_reserve_ahead=engine_pb2.KvShmReserveAhead(
        layout=kv_layout_to_pb(ahead.layout), num_tokens=ahead.num_tokens))
    _set_offer(message.shm_reserve_ahead.shm_offer, ahead.offer)
    return message


def shm_reserve_ahead_from_pb(message: engine_pb2.KvShmReserveAhead) -> ShmReserveAhead:
    return ShmReserveAhead(kv_layout_from_pb(message.layout), message.num_tokens,
                           shm_offer_from_pb(message) or ShmOffer(""))


def shm_answer_to_pb(answer: ShmReservation | ShmDeclined) -> engine_pb2.ImportKvReply:
    if isinstance(answer, ShmDeclined):
        return engine_pb2.ImportKvReply(shm_declined=engine_pb2.KvShmDeclined(reason=answer.reason))
    return engine_pb2.ImportKvReply(shm_reserved=engine_pb2.KvShmReserved(
        socket_name=answer.socket_name, segment_token=answer.segment_token, import_token=answer.import_token,
        slot_run_starts=[start for start, _ in answer.slot_runs],
        slot_run_lengths=[length for _, length in answer.slot_runs],
        accepts_written_with_commit=answer.accepts_written_with_commit,
        lease_on_watch=answer.lease_on_watch, control_on_watch=answer.control_on_watch,
        asks_lease_ahead=answer.asks_lease_ahead, reserves_ahead=answer.reserves_ahead))


def shm_answer_from_pb(reply: engine_pb2.ImportKvReply) -> ShmReservation | ShmDeclined | None:
    """The target's answer to an offer, or None if the reply is something else."""
    kind = reply.WhichOneof("kind")
    if kind == "shm_declined":
        return ShmDeclined(reply.shm_declined.reason)
    if kind == "shm_reserved":
        reserved = reply.shm_reserved
        return ShmReservation(reserved.socket_name, bytes(reserved.segment_token), bytes(reserved.import_token),
                              tuple(zip(reserved.slot_run_starts, reserved.slot_run_lengths)),
                              reserved.accepts_written_with_commit,
                              reserved.lease_on_watch, reserved.control_on_watch, reserved.asks_lease_ahead,
                              reserved.reserves_ahead)
    return None


def shm_written_to_pb(written: ShmWritten) -> engine_pb2.ImportKvMessage:
    return engine_pb2.ImportKvMessage(shm_written=engine_pb2.KvShmWritten(
        layer_crc32=written.layer_crc32s, commit=written.commit))


def shm_written_from_pb(message: engine_pb2.KvShmWritten) -> ShmWritten:
    return ShmWritten(tuple(message.layer_crc32), message.commit)
