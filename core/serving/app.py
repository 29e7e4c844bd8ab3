"""The HTTP side: an ASGI app (Starlette) with the routes and answers the ``openai`` client expects.

The app holds no run logic: a body is decoded and checked (``openai_api``), admitted by the
served model (tokenized, context checked) into the bounded queue (``scheduler``), and what the
cluster produces comes back through an asyncio queue fed from the coordinator's threads. A
stream's headers are sent only once its first piece (or its failure) is known, so a request
that cannot be served gets a proper status (503, 429) even with ``stream: true``; after that a
failure is an ``error`` event, which the ``openai`` client raises as an ``APIError``. A client
that disconnects cancels its request (``BatchQueue.cancel``). Every error is OpenAI's error
object; the key, when the server has one, is checked first, in constant time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.serving.cluster_runs import ServedModel
from core.serving.openai_api import (
    ApiError,
    Defaults,
    Kind,
    chunk_body,
    model_body,
    models_body,
    now_s,
    parse_request,
    response_body,
)
from core.serving.scheduler import BatchQueue
from core.serving.served import Failed, Finished, Piece, ServedRequest

DISCONNECT_POLL_S = 0.1
"""How often a request that has sent nothing yet checks that its client is still there."""
INLINE_ADMIT_BYTES = 16 << 10
"""A body up to this size is admitted (its prompt templated and tokenized, ~0.1 ms) on the event loop;
a larger one on a worker thread, so a long prompt does not hold up the other streams."""


class LoopPost:
    """Deliveries from the coordinator's threads to the streams' asyncio queues, handed to the event loop
    in one wake-up per burst: a step's tokens for 16 streams were 16 ``call_soon_threadsafe`` (16 writes
    to the loop's wake-up pipe, 16 loop turns); now the first schedules a drain and the rest join it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, object]] = []
        self._lock = threading.Lock()

    def post(self, inbox: asyncio.Queue, item) -> None:
        with self._lock:
            self._pending.append((inbox, item))
            if len(self._pending) > 1:
                return  # a drain is scheduled and not run yet: it takes this one too
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is gone (the server stopped)
            with self._lock:
                self._pending.clear()

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for inbox, item in batch:
            inbox.put_nowait(item)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class BearerAuth:
    """ASGI middleware: every request needs ``Authorization: Bearer <key>`` (401 otherwise).
    The digests of the given and the expected key are compared in constant time."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"")
            token = header[7:].strip() if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(hashlib.sha256(token).digest(), self._digest):
                what = "a wrong API key" if token else "no API key (send Authorization: Bearer KEY)"
                err = ApiError(401, f"the request carries {what}", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (by its Content-Length, else as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; this server takes at most {limit}",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes, this server's limit", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


class OpenAIRoutes:
    """The routes over one served model and its queue."""

    def __init__(self, model: ServedModel, queue: BatchQueue, defaults: Defaults, max_body_bytes: int) -> None:
        self.model, self.queue, self.defaults, self.max_body_bytes = model, queue, defaults, max_body_bytes
        self.created = now_s()
        self._post: LoopPost | None = None

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_body(self.model.name, self.created))

    async def model_info(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.model.name:
            return error_response(ApiError(404, f"the model {name!r} does not exist", param="model",
                                           code="model_not_found"))
        return JSONResponse(model_body(name, self.created))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: Kind) -> Response:
        try:
            raw = await _read_body(request, self.max_body_bytes)
            parsed = parse_request(raw, kind, self.defaults)
            loop = asyncio.get_running_loop()
            if self._post is None or self._post.loop is not loop:
                self._post = LoopPost(loop)
            post, inbox = self._post.post, asyncio.Queue()

            def deliver(item) -> None:  # on the coordinator's threads
                post(inbox, item)

            if len(raw) <= INLINE_ADMIT_BYTES:  # tokenized here: a thread hop costs more than a short prompt
                served = self.model.admit(parsed, deliver)
            else:
                served = await run_in_threadpool(self.model.admit, parsed, deliver)
            self.queue.submit(served)
        except ApiError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            first = await self._next(inbox, request, served)
        except ClientDisconnect:
            self.queue.cancel(served)
            return Response(status_code=499)
        if isinstance(first, Failed):
            return error_response(first.error)
        created = now_s()
        if parsed.stream:
            return StreamingResponse(self._stream(first, inbox, served, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, item = "", first
        try:
            while not isinstance(item, (Finished, Failed)):
                text += item.text
                item = await self._next(inbox, request, served)
        except ClientDisconnect:
            self.queue.cancel(served)
            return Response(status_code=499)
        if isinstance(item, Failed):
            return error_response(item.error)
        return JSONResponse(response_body(kind, served.id, self.model.name, created, text, item.reason,
                                          item.prompt_tokens, item.completion_tokens))

    async def _next(self, inbox: asyncio.Queue, request: Request, served: ServedRequest):
        """The next delivery; ``ClientDisconnect`` when the client left meanwhile (checked at least
        every ``DISCONNECT_POLL_S``, also while pieces keep coming)."""
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() - served.checked_s >= DISCONNECT_POLL_S:
                served.checked_s = loop.time()
                if await request.is_disconnected():
                    raise ClientDisconnect()
            try:
                return await asyncio.wait_for(inbox.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    async def _stream(self, first, inbox: asyncio.Queue, served: ServedRequest, created: int) -> AsyncIterator[bytes]:
        """Server-sent events until ``data: [DONE]``; leaving early (a disconnect) cancels the request."""
        kind, name, rid = served.parsed.kind, self.model.name, served.id
        item = first
        try:
            if kind == "chat":
                yield _sse(chunk_body(kind, rid, name, created, text="", first=True))
            while True:
                if isinstance(item, Piece):
                    yield _sse(chunk_body(kind, rid, name, created, text=item.text))
                elif isinstance(item, Finished):
                    yield _sse(chunk_body(kind, rid, name, created, finish_reason=item.reason,
                                          text=None if kind == "chat" else ""))
                    if served.parsed.include_usage:
                        yield _sse(chunk_body(kind, rid, name, created,
                                              usage_counts=(item.prompt_tokens, item.completion_tokens)))
                    yield _sse("[DONE]")
                    return
                elif isinstance(item, Failed):
                    yield _sse(item.error.body())
                    return
                item = await inbox.get()
        finally:
            if not served.done:
                self.queue.cancel(served)


def build_app(model: ServedModel, queue: BatchQueue, *, defaults: Defaults, api_key: str | None = None,
              max_body_bytes: int = 1 << 20):
    """The ASGI app serving ``model`` (wrapped in ``BearerAuth`` when there is a key)."""
    routes = OpenAIRoutes(model, queue, defaults, max_body_bytes)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail)), code=code))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, f"internal error: {exc}", type="server_error"))

    app = Starlette(routes=[
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{name:path}", routes.model_info, methods=["GET"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error})
    return BearerAuth(app, api_key) if api_key else app
