"""AssistStream, read on the caller's thread: replies in order, a read past its timeout, the server's end."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cpu_service.assist_stream import AssistStream, AssistUnavailable

METHOD = "/test.Echo/Stream"
HANG_GUARD_S = 10.0


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


def receive_under_guard(stream: AssistStream, timeout_s: float):
    """stream.receive(timeout_s) on a daemon thread; TimeoutError past HANG_GUARD_S."""
    outcome: list = []
    done = threading.Event()

    def read() -> None:
        try:
            outcome.append(("reply", stream.receive(timeout_s)))
        except AssistUnavailable as exc:
            outcome.append(("error", exc))
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(HANG_GUARD_S):
        raise TimeoutError(f"receive({timeout_s}) still blocked after {HANG_GUARD_S} s")
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


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
    # The message is the watchdog's (it cancels the call only once the read's deadline has
    # passed); a watchdog that never fires fails the hang guard instead of hanging the test.
    with pytest.raises(AssistUnavailable, match="no reply within the iteration timeout"):
        receive_under_guard(stream, 0.3)
    assert stream.ended.wait(HANG_GUARD_S)
    stream.close()
    channel.close()


def test_an_earlier_deadline_than_the_watchdogs_is_kept(address):
    channel, stream = _stream(address)
    stream.send(b"a")
    assert stream.receive(60.0) == b"re:a"  # the watchdog now sleeps until a deadline a minute away
    stream.send(b"silent")
    with pytest.raises(AssistUnavailable, match="no reply within"):
        receive_under_guard(stream, 0.2)  # not a minute: the watchdog woke for the earlier deadline
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
