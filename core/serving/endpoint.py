"""A whole serving endpoint put together over a coordinator: the served model (its plan loaded),
the queue, the app and uvicorn on a bound socket. ``edgeshard serve`` and the studio's Serve
toggle start the same thing, so what a studio user points a client at is what the CLI serves."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from core.serving.app import build_app
from core.serving.cluster_runs import ServedModel
from core.serving.http_server import HttpServer
from core.serving.openai_api import Defaults
from core.serving.scheduler import BatchQueue


@dataclass(frozen=True)
class EndpointLimits:
    """The queue's and the HTTP side's bounds (``edgeshard serve``'s options)."""

    max_queue: int = 64
    max_batch: int = 16
    batch_window_s: float = 0.0
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 5.0
    defaults: Defaults = field(default_factory=Defaults)


class ServingEndpoint:
    """``served`` (loaded) behind the OpenAI-compatible app on ``sock``, until ``stop``."""

    def __init__(self, served: ServedModel, sock: socket.socket, *, key: str | None, limits: EndpointLimits,
                 spread: int) -> None:
        self.served, self.limits, self.key = served, limits, key
        # Where rows join a running micro-batch a burst is one group (one prefill, then one micro-batch of up
        # to max_batch rows): per stage a step costs ~1.7 ms plus ~0.07 ms a row here, so two half-full
        # micro-batches cost nearly twice the CPU of one full one (docs/serving.md, Measured).
        self.queue = BatchQueue(served.start_batch, max_waiting=limits.max_queue, max_batch=limits.max_batch,
                                capacity=served.capacity, spread=1 if served.rows_join else spread, batch_window_s=limits.batch_window_s,
                                on_cancel_running=served.leave, join_now=served.join_now)
        served.on_slot_free = self.queue.wake
        served.max_rows = limits.max_batch
        app = build_app(served, self.queue, defaults=limits.defaults, api_key=key,
                        max_body_bytes=limits.max_body_bytes)
        self.http = HttpServer(app, sock, grace_s=limits.shutdown_grace_s)

    def start(self) -> None:
        self.http.start()

    @property
    def port(self) -> int:
        return self.http.port

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish for the grace time, fail the rest, unload."""
        try:
            self.http.stop(self.limits.shutdown_grace_s + 10)
        finally:
            self.queue.close()
            self.served.unload()

