"""status_for: the exception -> status code table."""

from __future__ import annotations

import grpc
import pytest

from dualpace.errors import DualPaceError, ModelLoadError
from dualpace.serve.status import status_for
from tests.serve.fake_services import raise_for


def _raised(kind: str) -> BaseException:
    try:
        raise_for(kind)
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError(f"{kind} raised nothing")


@pytest.mark.parametrize(
    ("kind", "code", "message"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0, got -1"),
        ("convert", grpc.StatusCode.INVALID_ARGUMENT, "finish_reason: unknown enum value 999"),
        ("notfound", grpc.StatusCode.NOT_FOUND, "request_id: no request 'r9'"),
        ("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)"),
        ("unavailable", grpc.StatusCode.UNAVAILABLE, "engine is stopping"),
        ("value", grpc.StatusCode.INTERNAL, "internal error: ValueError: a bug, not a bad message"),
        ("runtime", grpc.StatusCode.INTERNAL, "internal error: RuntimeError: boom"),
    ],
)
def test_status_for(kind: str, code: grpc.StatusCode, message: str) -> None:
    assert status_for(_raised(kind)) == (code, message)


def test_other_dualpace_errors_are_failed_precondition() -> None:
    assert status_for(ModelLoadError("no such file")) == (grpc.StatusCode.FAILED_PRECONDITION, "no such file")
    assert status_for(DualPaceError("x")) == (grpc.StatusCode.FAILED_PRECONDITION, "x")


def test_internal_message_is_short() -> None:
    code, message = status_for(KeyError("k" * 1000))
    assert code == grpc.StatusCode.INTERNAL
    assert len(message) < 260 and message.endswith("...")
