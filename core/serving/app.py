"""The HTTP side: an ASGI app (Starlette) with the routes and answers the ``openai`` client expects.

The app holds no run logic: a body is decoded and checked (``openai_api``), admitted by the
served model (tokenized, context checked) into the bounded queue (``scheduler``), and what the
cluster produces comes back through the request's ``Inbox``, fed from the coordinator's threads. A
stream's headers are sent only once the stages accepted its join (or it failed before), so a request
that cannot be served gets a proper status (503, 429) even with ``stream: true``; after that a
failure is an ``error`` event, which the ``openai`` client raises as an ``APIError``. A client
that disconnects cancels its request (``BatchQueue.cancel``). Every error is OpenAI's error
object; the key, when the server has one, is checked first, in constant time.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import threading
from collections.abc import AsyncIterator, Callable

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
from core.serving.served import Failed, Finished, Joined, Piece, ServedRequest

DISCONNECT_POLL_S = 0.1
"""How often a request that has sent nothing yet checks that its client is still there."""
INLINE_ADMIT_BYTES = 16 << 10
"""A body up to this size is admitted (its prompt templated and tokenized, ~0.1 ms) on the event loop;
a larger one on a worker thread, so a long prompt does not hold up the other streams."""


class Inbox:
    """One request's deliveries on the event loop. ``put`` (on the loop) wakes its one waiter by resolving
    the future it awaits: the coroutine runs on the next loop turn. An ``asyncio.Queue`` read through
    ``asyncio.wait_for`` (for the disconnect check's timeout) took two more turns, a task each, per token."""

    NOTHING = object()
    """What ``get`` returns when its timeout passed first."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def get_nowait(self):
        """The next delivery if one is here, else ``NOTHING``."""
        return self._items.popleft() if self._items else self.NOTHING

    async def get(self, timeout_s: float | None = None):
        """The next delivery, or ``NOTHING`` after ``timeout_s`` (None: no limit)."""
        if not self._items:
            waiter = self._waiter = self.loop.create_future()
            timer = None if timeout_s is None else self.loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                return self.NOTHING
        return self._items.popleft()


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class LoopPost:
    """Deliveries from the coordinator's threads to the requests' inboxes, handed to the event loop
    in one wake-up per burst: a step's tokens for 16 streams were 16 ``call_soon_threadsafe`` (16 writes
    to the loop's wake-up pipe, 16 loop turns); now the first schedules a drain and the rest join it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[Inbox, object]] = []
        self._lock = threading.Lock()

    def post(self, inbox: Inbox, item) -> None:
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
            inbox.put(item)


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


class PieceEvents:
    """One stream's text-piece events, ``_sse(chunk_body(..., text=t))`` byte for byte, from a template made once:
    the chunk around its text is the same for every token, and ``json.dumps`` escapes a string alone as it
    does inside the chunk (building and encoding the whole chunk was ~4 µs a token, this ~1)."""

    MARK = "\ue000"

    def __init__(self, kind: Kind, request_id: str, model: str, created: int) -> None:
        self._chunk = (kind, request_id, model, created)
        parts = _sse(chunk_body(kind, request_id, model, created, text=self.MARK)).split(json.dumps(self.MARK).encode())
        self._parts = parts if len(parts) == 2 else None  # a model name with the mark: chunk by chunk

    def __call__(self, text: str) -> bytes:
        if self._parts is None:
            return _sse(chunk_body(*self._chunk, text=text))
        return self._parts[0] + json.dumps(text).encode() + self._parts[1]


class EventStream(StreamingResponse):
    """Server-sent events: the headers go out at once, the first event as soon as the body has it, both on the
    request's own task (Starlette's ``StreamingResponse``, under ASGI 2.3 as uvicorn speaks it, sends
    nothing before a task it starts for its body runs: a loop turn and a task group's set-up on the first
    token's path). The rest streams as it does there, while it listens for the client's disconnect. The body
    itself notices a disconnect before its first event. ``on_end`` is told when the stream ends, however it
    ends (a disconnect may cancel the body before it started, so its generator's ``finally`` may never run)."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            first = await anext(self.body_iterator, None)
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                await super().__call__(scope, receive, send)
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientDisconnect:
            pass
        finally:
            self.on_end()

    async def stream_response(self, send) -> None:
        """The events after the first (the headers and the first are out)."""
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
            post, inbox = self._post.post, Inbox(loop)

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
        if parsed.stream:  # its status is known: the headers go out now, while the prefill runs
            return EventStream(self._stream(first, inbox, request, served, created),
                               on_end=lambda: None if served.done else self.queue.cancel(served))
        text, item = "", first
        try:
            while not isinstance(item, (Finished, Failed)):
                text += item.text if isinstance(item, Piece) else ""
                item = await self._next(inbox, request, served)
        except ClientDisconnect:
            self.queue.cancel(served)
            return Response(status_code=499)
        if isinstance(item, Failed):
            return error_response(item.error)
        return JSONResponse(response_body(kind, served.id, self.model.name, created, text, item.reason,
                                          item.prompt_tokens, item.completion_tokens))

    async def _next(self, inbox: Inbox, request: Request, served: ServedRequest):
        """The next delivery; ``ClientDisconnect`` when the client left meanwhile (checked at least
        every ``DISCONNECT_POLL_S``, also while pieces keep coming)."""
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() - served.checked_s >= DISCONNECT_POLL_S:
                served.checked_s = loop.time()
                if await request.is_disconnected():
                    raise ClientDisconnect()
            item = await inbox.get(DISCONNECT_POLL_S)
            if item is not Inbox.NOTHING:
                return item

    def _events(self, item, served: ServedRequest, created: int, pieces: PieceEvents) -> tuple[bytes, bool]:
        """A delivery's server-sent events, and whether they end the stream (``data: [DONE]`` or an error)."""
        kind, name, rid = served.parsed.kind, self.model.name, served.id
        if isinstance(item, Piece):
            return pieces(item.text), False
        if isinstance(item, Finished):
            out = _sse(chunk_body(kind, rid, name, created, finish_reason=item.reason,
                                  text=None if kind == "chat" else ""))
            if served.parsed.include_usage:
                out += _sse(chunk_body(kind, rid, name, created,
                                       usage_counts=(item.prompt_tokens, item.completion_tokens)))
            return out + _sse("[DONE]"), True
        return _sse(item.error.body()), True

    async def _stream(self, first, inbox: Inbox, request: Request, served: ServedRequest,
                      created: int) -> AsyncIterator[bytes]:
        """The events of the deliveries from ``first`` on, until ``data: [DONE]`` (or an error event). Until the
        first token's, the client's disconnect is checked here (``ClientDisconnect``); after it, the response
        listens for it. A chat stream's first event (its role) goes out with the first token's. Deliveries that
        are already here when one is taken go out with it, in one write (a stream behind by a few steps)."""
        item, pieces = first, PieceEvents(served.parsed.kind, served.id, self.model.name, created)
        while isinstance(item, Joined):
            item = await self._next(inbox, request, served)
        events, ended = self._events(item, served, created, pieces)
        if served.parsed.kind == "chat":
            events = _sse(chunk_body("chat", served.id, self.model.name, created, text="", first=True)) + events
        yield events
        while not ended:
            item, out = await inbox.get(), b""
            while item is not Inbox.NOTHING and not ended:
                if not isinstance(item, Joined):
                    events, ended = self._events(item, served, created, pieces)
                    out += events
                item = inbox.get_nowait()
            if out:
                yield out


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
