"""Conversion of the data-socket KV transfer messages (dualpace.engine.transfer.kv_tcp_import) <-> protobuf."""

from __future__ import annotations

from dualpace.engine.transfer.kv_tcp_import import TcpDeclined, TcpReservation, TcpWritten
from dualpace.wire.v1 import engine_pb2


def add_tcp_offer(message: engine_pb2.ImportKvMessage) -> engine_pb2.ImportKvMessage:
    """The header message, offering the data socket."""
    message.header.tcp_offer.SetInParent()
    return message


def has_tcp_offer(header: engine_pb2.ImportKvHeader) -> bool:
    return header.HasField("tcp_offer")


def tcp_answer_to_pb(answer: TcpReservation | TcpDeclined) -> engine_pb2.ImportKvReply:
    if isinstance(answer, TcpDeclined):
        return engine_pb2.ImportKvReply(tcp_declined=engine_pb2.KvTcpDeclined(reason=answer.reason))
    return engine_pb2.ImportKvReply(tcp_reserved=engine_pb2.KvTcpReserved(
        port=answer.port, ticket=answer.ticket, tls=answer.tls))


def tcp_answer_from_pb(reply: engine_pb2.ImportKvReply) -> TcpReservation | TcpDeclined | None:
    """The target's answer to a data-socket offer, or None if the reply is something else."""
    kind = reply.WhichOneof("kind")
    if kind == "tcp_declined":
        return TcpDeclined(reply.tcp_declined.reason)
    if kind == "tcp_reserved":
        return TcpReservation(reply.tcp_reserved.port, bytes(reply.tcp_reserved.ticket), reply.tcp_reserved.tls)
    return None


def tcp_written_to_pb(written: TcpWritten) -> engine_pb2.ImportKvMessage:
    return engine_pb2.ImportKvMessage(tcp_written=engine_pb2.KvTcpWritten(layer_crc32=written.layer_crc32s,
                                                                          commit=written.commit))


def tcp_written_from_pb(message: engine_pb2.KvTcpWritten) -> TcpWritten:
    return TcpWritten(tuple(message.layer_crc32), message.commit)
