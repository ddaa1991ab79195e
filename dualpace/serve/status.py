"""The one mapping from exceptions to gRPC status codes.

Servicers raise plain exceptions and never call `context.abort` for them; the
interceptor (dualpace.serve.interceptor) turns what escapes into a status with
`status_for`. The message of a DualPaceError already names the field or the
request, so it is sent as it is, without parsing text.
"""

from __future__ import annotations

import types

import grpc

from dualpace import errors

# dualpace.errors class name -> status code, most specific first. Names the
# errors module does not define (yet) are skipped, so the table can name
# classes before they exist.
_ERROR_CODES: tuple[tuple[str, grpc.StatusCode], ...] = (
    ("InvalidArgument", grpc.StatusCode.INVALID_ARGUMENT),
    ("RequestNotFound", grpc.StatusCode.NOT_FOUND),
    ("Overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("Unavailable", grpc.StatusCode.UNAVAILABLE),
    ("AlreadyExists", grpc.StatusCode.ALREADY_EXISTS),
    ("DataLoss", grpc.StatusCode.DATA_LOSS),
    ("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED),
    ("FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION),
    ("ModelLoadError", grpc.StatusCode.FAILED_PRECONDITION),
)

# Any other DualPaceError is a condition the caller can act on, not a bug.
_OTHER_DUALPACE_CODE = grpc.StatusCode.FAILED_PRECONDITION

# The wire's conversion modules raise ValueError for malformed messages.
_CONVERSION_MODULES = ("dualpace.wire.common", "dualpace.wire.tensors", "dualpace.wire.assist_messages")

_MAX_INTERNAL_DETAIL_CHARS = 200


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Returns the status code and message a client sees for `exc`.

    - dualpace.errors classes per the table above, message = str(exc);
    - ValueError raised inside the wire's conversion (common, tensors, assist_messages)
      -> INVALID_ARGUMENT;
    - a failed upstream call (grpc.aio.AioRpcError, e.g. the router relaying an
      engine's answer) -> the upstream code and details, unchanged;
    - anything else -> INTERNAL with a short message (the caller logs the trace).
    """
    if isinstance(exc, errors.DualPaceError):
        for class_name, code in _ERROR_CODES:
            error_class = getattr(errors, class_name, None)
            if error_class is not None and isinstance(exc, error_class):
                return code, str(exc)
        return _OTHER_DUALPACE_CODE, str(exc)
    if isinstance(exc, ValueError) and any(raised_in_module(exc, name) for name in _CONVERSION_MODULES):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.INTERNAL, internal_message(exc)


def is_internal(code: grpc.StatusCode) -> bool:
    """True when the status means a bug on the server (its traceback is worth logging)."""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def internal_message(exc: BaseException) -> str:
    """A short INTERNAL message: exception type and the start of its text."""
    detail = str(exc)
    if len(detail) > _MAX_INTERNAL_DETAIL_CHARS:
        detail = detail[:_MAX_INTERNAL_DETAIL_CHARS] + "..."
    name = type(exc).__name__
    return f"internal error: {name}: {detail}" if detail else f"internal error: {name}"


def raised_in_module(exc: BaseException, module_name: str) -> bool:
    """True when any frame of the exception's traceback runs code of `module_name`."""
    traceback: types.TracebackType | None = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_globals.get("__name__") == module_name:
            return True
        traceback = traceback.tb_next
    return False
