"""Requests that protobuf refuses to parse, named by field.

proto3 string fields must hold UTF-8. A client that sends other bytes there (a lone UTF-16
surrogate such as "\\ud800" encoded by a lenient encoder, or any invalid byte sequence) makes
the generated parser raise DecodeError, which grpc turns into INTERNAL "Exception
deserializing request!": a server error for a client's mistake, naming nothing. The lenient
deserializer here returns an `UndecodableRequest` instead, naming the first string field whose
bytes are not UTF-8 (by walking the wire format against the message's descriptor), and the
server's interceptor answers INVALID_ARGUMENT with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

MAX_DEPTH = 32  # nesting walked before giving up on naming the field


@dataclass(frozen=True)
class UndecodableRequest:
    field: str  # e.g. "text", "messages.messages[1].content", or "request" when no field can be named
    problem: str


def lenient_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Wraps a generated `Message.FromString`: a message that does not parse becomes an
    UndecodableRequest naming the field (other deserializers are returned as they are)."""
    message_class = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    if not isinstance(descriptor, Descriptor):
        return deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            try:
                field = first_non_utf8_field(descriptor, data)
            except Exception:  # noqa: BLE001 - naming the field is best effort; the answer stays a 4xx
                field = None
            if field is None:
                return UndecodableRequest("request", f"is not a valid {descriptor.full_name} message: {exc}")
            return UndecodableRequest(field, "is not valid UTF-8 (a proto3 string must be; a lone UTF-16 "
                                             "surrogate such as \\ud800 is not a character)")

    return deserialize


def first_non_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
    """The path of the first string field (nested messages included) whose bytes are not UTF-8;
    None when there is none or the bytes are not well-formed wire format."""
    if depth > MAX_DEPTH:
        return None
    seen: dict[int, int] = {}
    position = 0
    try:
        while position < len(data):
            key, position = _varint(data, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, position = _varint(data, position)
            elif wire_type == 1:
                position += 8
            elif wire_type == 5:
                position += 4
            elif wire_type == 2:
                length, position = _varint(data, position)
                chunk, position = data[position:position + length], position + length
                found = _check_chunk(descriptor, number, chunk, seen, prefix, depth)
                if found is not None:
                    return found
            else:
                return None  # groups, or not wire format
    except IndexError:
        return None
    return None


def _check_chunk(descriptor: Descriptor, number: int, chunk: bytes, seen: dict[int, int], prefix: str,
                 depth: int) -> str | None:
    field = descriptor.fields_by_number.get(number)
    if field is None:
        return None
    name = prefix + field.name
    if _is_repeated(field):
        name += f"[{seen.get(number, 0)}]"
        seen[number] = seen.get(number, 0) + 1
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return name
        return None
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return first_non_utf8_field(field.message_type, chunk, name + ".", depth + 1)
    return None


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # newer protobuf; older ones have label
    if repeated is not None:
        return bool(repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
