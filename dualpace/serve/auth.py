"""An optional shared bearer token between the daemons (`--auth-token-file PATH`).

Server side: `AuthInterceptor(token)` answers UNAUTHENTICATED to any call whose
metadata lacks `authorization: Bearer TOKEN`, except the gRPC health service,
which stays readable so launchers and load balancers can probe without the token.

Client side: the daemons' own outgoing calls (KV migration, Dense Assist, the
router's engine calls) carry the token when one is configured:
`token_metadata(token)` for a single call, `aio_token_interceptors(token)` for a
grpc.aio channel whose every call should carry it.

The token is a secret in a file (mode 0600), never a command-line value, so it
does not show in `ps`. It is compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from dualpace.errors import InvalidArgument
from dualpace.serve.metrics import error as count_error

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token (send metadata 'authorization: Bearer TOKEN')"


def read_token_file(path: str | Path | None, field: str = "--auth-token-file") -> str | None:
    """The token in `path` (surrounding whitespace stripped); None when path is None.
    Raises InvalidArgument(field, ...) when the file is unreadable, empty or not one printable word."""
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except OSError as exc:
        raise InvalidArgument(field, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InvalidArgument(field, f"{path} is not ASCII text") from None
    if not token:
        raise InvalidArgument(field, f"{path} is empty")
    if not all("!" <= ch <= "~" for ch in token):
        raise InvalidArgument(field, f"the token in {path} must be one word of printable ASCII")
    return token


def bearer(token: str) -> str:
    return f"Bearer {token}"


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the token; empty when there is none."""
    return () if token is None else ((AUTHORIZATION, bearer(token)),)


# ----------------------------------------------------------------- server side


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the bearer token with UNAUTHENTICATED (health is exempt)."""

    def __init__(self, token: str):
        self._expected = bearer(token).encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _rejecting(handler)

    def authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key.lower() == AUTHORIZATION:
                presented = value if isinstance(value, bytes) else str(value).encode()
                if hmac.compare_digest(presented, self._expected):
                    return True
        return False


async def _reject(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    count_error(grpc.StatusCode.UNAUTHENTICATED.name)
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (and serializers) as `handler` that only aborts."""
    if handler.request_streaming and handler.response_streaming:
        factory = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        factory = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        factory = grpc.unary_stream_rpc_method_handler
    else:
        factory = grpc.unary_unary_rpc_method_handler
    return factory(_reject, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


# ----------------------------------------------------------------- client side


class _AddsToken:
    def __init__(self, token: str):
        self._pair = (AUTHORIZATION, bearer(token))

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryUnary(_AddsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_AddsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_AddsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_AddsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


def aio_token_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for grpc.aio.*_channel(interceptors=...) adding the token to every call
    (one per call kind: a channel files each interceptor under one kind only)."""
    if token is None:
        return []
    return [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token), _StreamStream(token)]
