"""The router's OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions,
/health and /metrics.

It is a second door into the same router: every generation request goes through
router.prompts.prepare_prompt (in the prompt pool, router/prompt_work.py) and a
router.relay.Relay on the RouterCore the gRPC servicer uses, in the same asyncio event loop,
so admission, migration, recovery and stop strings behave exactly as for gRPC clients.

Why aiohttp: it is a plain asyncio server that runs as one more task in the loop that already
runs grpc.aio (no second loop, no thread, no ASGI server process to manage), streams with
`StreamResponse.write`, and can cancel a handler when its client disconnects
(`handler_cancellation=True`), which is how a dropped stream reaches the engine as an Abort.

A client that goes away mid-request — while its request waits for room, during the prefill or
mid-stream — cancels the handler or fails its next write; either way the Relay generator is
closed (`contextlib.aclosing`), and Relay.run's `finally` aborts the request in its engine, which
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import ssl
import time
import uuid
from dataclasses import dataclass

import grpc
from aiohttp import web

from dualpace.errors import DualPaceError, InvalidArgument
from dualpace.sampling_params import FinishReason
from dualpace.serve import metrics
from dualpace.serve.address import parse_listen
from router import openai_responses as responses
from router import openai_schema as schema
from router.openai_schema import ApiError, ParsedRequest
from router.fan_out import Choice, FanOut, choice_request_id
from router.openai_answer import Answer
from router.prompts import request_id_for
from router.relay import RelayUpdate, open_request
from router.router_core import RouterCore

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
SHUTDOWN_GRACE_S = 5.0  # in-flight HTTP requests get this long when the router stops, like gRPC calls
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
CLIENT_CLOSED = "client_closed"  # the status label of a request whose client went away


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _json_response(body: dict, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda b: json.dumps(b, ensure_ascii=False))


class HttpFront:
    """The HTTP handlers over one RouterCore; `application()` builds the aiohttp app."""

    def __init__(self, core: RouterCore, model_id: str, auth_token: str | None = None):
        self.core = core
        self.model_id = model_id  # what /v1/models lists and requests must name
        # The router's --auth-token-file token: as for gRPC, every endpoint but /health needs
        # `Authorization: Bearer TOKEN` (what OpenAI clients send as their API key).
        self._expected = f"Bearer {auth_token}".encode() if auth_token is not None else None
        self.created = int(time.time())
        self.metrics = metrics.http_metrics()  # counters in the process's Prometheus registry

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._answer_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id:.+}", self.get_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _answer_errors(self, request: web.Request, handler) -> web.StreamResponse:
        """ApiError, aiohttp's own 404/405/413 and bugs become OpenAI-style JSON errors; every
        answer is counted by endpoint and status."""
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        status = "500"
        try:
            if self._expected is not None and request.path != "/health":
                presented = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(presented, self._expected):
                    raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer TOKEN' with the "
                                   "router's token)", type="authentication_error", code="invalid_api_key")
            response = await handler(request)
            status = request.get("outcome", str(response.status))
            return response
        except ApiError as exc:
            status = str(exc.status)
            return _json_response(exc.body(), exc.status)
        except web.HTTPException as exc:
            status = str(exc.status)
            if exc.status < 400:
                raise
            error = ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                             type="invalid_request_error", code=exc.reason.lower().replace(" ", "_"))
            return _json_response(error.body(), exc.status)
        except asyncio.CancelledError:
            status = CLIENT_CLOSED  # the client disconnected (or the server is stopping)
            raise
        except Exception as exc:
            log.exception("HTTP %s %s failed", request.method, request.path)
            error = schema.error_for(exc)
            status = str(error.status)
            return _json_response(error.body(), error.status)
        finally:
            self.metrics.requests.labels(endpoint, status).inc()

    @staticmethod
    async def _body(request: web.Request):
        # Refused from its declared length, unread: reading megabytes on the event loop stalls every stream.
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, request.content_length)
        raw = await request.read()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise schema.invalid(None, f"the request body is not valid JSON: {exc}") from None

    # ------------------------------------------------------------------ small endpoints

    async def list_models(self, request: web.Request) -> web.Response:
        card = responses.model_card(self.model_id, self.created, self.core.max_context_tokens)
        return _json_response({"object": "list", "data": [card]})

    async def get_model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model_id"])
        return _json_response(responses.model_card(self.model_id, self.created, self.core.max_context_tokens))

    async def health(self, request: web.Request) -> web.Response:
        engines = {h.name: "healthy" if h.healthy else "unhealthy" for h in self.core.pool.handles}
        ok = any(h.healthy for h in self.core.pool.handles)
        return _json_response({"status": "ok" if ok else "unavailable", "engines": engines}, 200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        """The process's whole registry (dualpace.serve.metrics): the same text as --metrics-port."""
        return web.Response(body=metrics.render(), headers={"Content-Type": metrics.CONTENT_TYPE})

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(404, f"model: {model!r} is not served here; this router serves {self.model_id!r}",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, schema.parse_completion(await self._body(request)), "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, schema.parse_chat(await self._body(request)), "chatcmpl")

    async def _generate(self, request: web.Request, parsed: ParsedRequest, id_prefix: str) -> web.StreamResponse:
        self._check_model(parsed.model)
        core = self.core
        num_choices = parsed.candidates * len(parsed.clients)  # engine requests (best_of > n: candidates)
        try:
            if parsed.client.request_id is not None:
                request_id = request_id_for(parsed.client)
            else:
                request_id = f"{id_prefix}-{uuid.uuid4().hex}"
            # Choice 0 of every prompt now (each prompt tokenized and checked); fan_out starts the rest.
            default_max_tokens = schema.CHAT_DEFAULT_MAX_TOKENS if parsed.default_max_tokens else None
            relays = [await open_request(core, client,
                                         choice_request_id(request_id, p * parsed.candidates, num_choices),
                                         default_max_tokens=default_max_tokens)
                      for p, client in enumerate(parsed.clients)]
        except DualPaceError as exc:
            raise schema.error_for(exc, parsed.renamed) from None
        fan_out = FanOut(core, request_id, relays, parsed.candidates)
        answer = Answer(parsed, request_id, self.model_id, fan_out)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in relays))
        self.metrics.running.inc()
        try:
            # aclosing: however this ends (finished, error, client gone, handler cancelled), the
            # generator is closed, so Relay.run's finally aborts an unfinished request in its engine.
            async with contextlib.aclosing(fan_out.updates()) as updates:
                if parsed.stream:
                    return await self._stream(request, answer, updates)
                return await self._whole(answer, updates)
        finally:
            self.metrics.running.dec()

    async def _next(self, answer: Answer, updates) -> tuple[Choice, RelayUpdate]:
        try:
            choice, update = await anext(updates)
        except StopAsyncIteration:
            raise ApiError(503, f"request {answer.request_id} ended without a finish reason",
                           type="unavailable_error", code="unavailable") from None
        except (DualPaceError, grpc.aio.AioRpcError) as exc:
            raise schema.error_for(exc, answer.parsed.renamed) from None
        self.metrics.generation_tokens.inc(len(update.token_ids))
        if update.finish_reason == FinishReason.ERROR:
            raise ApiError(500, f"engine {update.engine} could not continue request {choice.relay.request_id} "
                           "(finish reason error)", type="server_error", code="engine_error")
        return choice, update

    async def _whole(self, answer: Answer, updates) -> web.Response:
        while not answer.finished:
            answer.add(*await self._next(answer, updates))
        return _json_response(answer.whole())

    async def _stream(self, request: web.Request, answer: Answer, updates) -> web.StreamResponse:
        # The first token comes before any header: a request refused at admission (429, 503) or
        # failing before its first token still gets a plain HTTP error status.
        choice, update = await self._next(answer, updates)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            try:
                for chunk in answer.opening():
                    await response.write(_sse(chunk))
                while True:
                    answer.add(choice, update)
                    for chunk in answer.chunks(choice, update):
                        await response.write(_sse(chunk))
                    if answer.finished:
                        break
                    choice, update = await self._next(answer, updates)
                if answer.parsed.include_usage:
                    await response.write(_sse(answer.usage_chunk()))
            except ConnectionResetError:
                raise
            except Exception as exc:  # after the headers: the error travels as an event, as OpenAI's does
                if not isinstance(exc, ApiError):
                    log.exception("HTTP stream of %s failed", answer.request_id)
                error = schema.error_for(exc)
                request["outcome"] = str(error.status)
                await response.write(_sse(error.body()))
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except ConnectionResetError:  # the client went away; leaving closes the relay (an Abort)
            request["outcome"] = CLIENT_CLOSED
        return response


# ---------------------------------------------------------------------- serving


@dataclass
class RunningHttp:
    runner: web.AppRunner
    address: str  # host:port a local client connects to (the real port)

    async def stop(self) -> None:
        """Stops listening; in-flight requests get the grace period, then are cancelled (and aborted)."""
        await self.runner.cleanup()


def server_ssl_context(cert: str | None, key: str | None, client_ca: str | None = None) -> ssl.SSLContext | None:
    """HTTPS from the router's --tls-cert/--tls-key (and --tls-client-ca: client certificates
    required); None without them."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
        if client_ca is not None:
            context.load_verify_locations(cafile=client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument("--tls-cert", f"cannot use {cert} / {key} for HTTPS: {exc}") from None
    return context


async def start_http(front: HttpFront, listen: str, tls_cert: str | None = None, tls_key: str | None = None,
                     tls_client_ca: str | None = None, *, grace_s: float = SHUTDOWN_GRACE_S,
                     listen_field: str = "--http-listen") -> RunningHttp:
    """Serves `front` on `listen` (HOST:PORT, port 0: a free one) in the running event loop; HTTPS
    when given the TLS files. On stop, in-flight requests get grace_s before they are cancelled."""
    address = parse_listen(listen, listen_field)
    context = server_ssl_context(tls_cert, tls_key, tls_client_ca)
    runner = web.AppRunner(front.application(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=grace_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, address.host, address.port, ssl_context=context).start()
    except OSError as exc:
        await runner.cleanup()
        raise InvalidArgument(listen_field, f"cannot bind {address.target()}: {exc.strerror or exc}") from None
    port = runner.addresses[0][1]
    return RunningHttp(runner, address.connect_target(port))

