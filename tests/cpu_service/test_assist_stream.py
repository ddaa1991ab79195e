"""AssistStream, read on the caller's thread: replies in order, a read past its timeout, the server's end."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cpu_service.assist_stream import AssistStream, AssistUnavailable

METHOD = "/test.Echo/Stream"


def _identity(data: bytes) -> bytes:
    return data


def _behave(request_iterator, context):
    for request in request_iterator:
        if request == b"silent":
            continue  # never answered
        if request == b"abort":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "told to abort")
        if request == b"end":
            return
        yield b"re:" + request


@pytest.fixture
def address():
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(_behave, _identity, _identity)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _stream(address: str) -> tuple[grpc.Channel, AssistStream]:
    channel = grpc.insecure_channel(address)
    return channel, AssistStream(channel.stream_stream(METHOD, _identity, _identity), address)


def test_replies_come_in_order_on_the_callers_thread(address):
    channel, stream = _stream(address)
    for i in range(50):
        stream.send(b"%d" % i)
        assert stream.receive(10.0) == b"re:%d" % i
    stream.close()
    channel.close()


def test_a_read_past_its_timeout_raises_and_ends_the_call(address):
    channel, stream = _stream(address)
    stream.send(b"x")
    assert stream.receive(10.0) == b"re:x"
    stream.send(b"silent")
    started_s = time.monotonic()
    with pytest.raises(AssistUnavailable, match="no reply within the iteration timeout"):
        stream.receive(0.3)
    assert 0.25 <= time.monotonic() - started_s < 10.0  # bounded: the watchdog cancelled the call
    assert stream.ended.wait(10.0)
    stream.close()
    channel.close()


def test_an_earlier_deadline_than_the_watchdogs_is_kept(address):
    channel, stream = _stream(address)
    stream.send(b"a")
    assert stream.receive(60.0) == b"re:a"  # the watchdog now sleeps until a deadline a minute away
    stream.send(b"silent")
    with pytest.raises(AssistUnavailable, match="no reply within"):
        stream.receive(0.2)
    stream.close()
    channel.close()


@pytest.mark.parametrize("request_, match, code", [(b"abort", "RESOURCE_EXHAUSTED: told to abort",
                                                    grpc.StatusCode.RESOURCE_EXHAUSTED),
                                                   (b"end", "the server ended the stream", None)])
def test_the_servers_end_is_reported_and_sets_ended(address, request_, match, code):
    channel, stream = _stream(address)
    ended_calls = []
    stream.on_end = lambda: ended_calls.append(True)
    stream.send(request_)
    with pytest.raises(AssistUnavailable, match=match) as raised:
        stream.receive(10.0)
    assert raised.value.code == code
    assert stream.ended.wait(10.0) and ended_calls == [True]
    stream.close()
    channel.close()
