"""A GPU stage's boundary activations on their way to and from the wire, through pinned host buffers.

Only a stage's boundary crosses PCIe: its output hidden states go to the host for the next agent,
the previous agent's come back onto the GPU. ``BoundaryCopies`` does both through page-locked
buffers reused per shape. In a run (``StageRun`` asks with ``deferred()``) an output is copied on a
side stream, after the computing stream made it, and comes back as ``PendingHost`` at once; the
run hands it to ``OrderedSends``, whose thread waits for that copy and sends, while the stage's
thread goes on to compute the next micro-batch: copy and send overlap the next step. Outside
``deferred()`` (other callers of a stage: tests, speculative verification, the last stage's
sampling) the copy is waited for and a host tensor returned, as before.

The device side goes through ``agents.accelerators.CudaBackend`` (its streams, events, pinned
buffers), so a test hands a backend that copies on a thread of this CPU under a GPU's name.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading

import torch

from agents.accelerators import CUDA, CudaBackend


class PendingHost:
    """A stage output on its way into a pinned host buffer: ``wait()`` gives it as a host tensor of its own
    (the buffer goes back to its pool for a later step of that shape)."""

    def __init__(self, owner: "BoundaryCopies", source: torch.Tensor, buffer: torch.Tensor, done) -> None:
        self._owner, self._source, self._buffer, self._done = owner, source, buffer, done

    def ready(self) -> bool:
        """Whether the copy has finished (a send waiting on it would not block)."""
        return bool(self._done.query())

    def wait(self) -> torch.Tensor:
        self._done.synchronize()
        host = self._buffer.clone()  # the wire keeps this one: zmq may still read it after the buffer is reused
        self._owner._give_back(self._buffer)
        self._source = None  # the GPU tensor may be freed now the copy has read it
        return host


class BoundaryCopies:
    """One GPU stage's pinned buffers and copy stream (``agents.shard.StageExecutor`` on a GPU)."""

    def __init__(self, torch_device: str, backend: CudaBackend = CUDA) -> None:
        self.backend = backend
        self.device = backend.place(torch_device)
        self._stream = backend.copy_stream(torch_device)
        self._free: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
        self._inbound: dict[tuple, tuple[torch.Tensor, object]] = {}
        self._lock = threading.Lock()  # buffers come back on the sending thread
        self._deferring = False
        self.buffers_made = 0
        """Pinned output buffers allocated so far: one per shape and copy in flight, not one per step."""

    @contextlib.contextmanager
    def deferred(self):
        """Within it, ``to_host`` answers ``PendingHost`` without waiting for the copy."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def to_host(self, out: torch.Tensor):
        """``out``'s copy into a pinned buffer of its shape, started on the side stream: ``PendingHost``
        inside ``deferred()``, else the host tensor once it is done."""
        key = (tuple(out.shape), out.dtype)
        with self._lock:
            free = self._free[key]
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = self.backend.pinned(key[0], key[1])
            self.buffers_made += 1
        pending = PendingHost(self, out, buffer, self.backend.copy_to_host(out, buffer, self._stream))
        return pending if self._deferring else pending.wait()

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A received host tensor on the GPU through a pinned buffer of its shape (queued on the computing
        stream); the buffer is written again only once its last upload is done."""
        if x.device.type != "cpu":
            return x.to(self.device)
        key = (tuple(x.shape), x.dtype)
        buffer, last = self._inbound.get(key, (None, None))
        if buffer is None:
            buffer = self.backend.pinned(key[0], key[1])
        elif last is not None:
            last.synchronize()
        buffer.copy_(x)
        out, done = self.backend.copy_to_device(buffer, self.device)
        self._inbound[key] = (buffer, done)
        return out

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free[(tuple(buffer.shape), buffer.dtype)].append(buffer)


OVERLAP_ENV = "EDGESHARD_COPY_OVERLAP"
"""``0``: a GPU stage's run waits for each output's copy before sending it (bench/gpu_check.sh times both)."""


def overlap_wanted() -> bool:
    return os.environ.get(OVERLAP_ENV, "1") != "0"


class OrderedSends:
    """A link sender whose sends leave in the order they were asked for, from one thread: a ``PendingHost``
    is sent once its copy is done (``after``), so the stage's thread does not wait for it; anything sent
    meanwhile (``send``: a retire, a shrink) queues behind it. Errors surface on the next call or ``close``."""

    def __init__(self, sender) -> None:
        self.sender = sender
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self.overlapped = 0
        """Sends whose copy was still running when the stage's thread had already moved on."""
        self._thread = threading.Thread(target=self._serve, name="edgeshard-copy-send", daemon=True)
        self._thread.start()

    @property
    def shaped(self) -> bool:
        return self.sender.shaped

    def after(self, pending: PendingHost, then) -> None:
        """``then(host)`` on the sending thread once ``pending``'s copy is done (``host``: its host tensor)."""
        self._put(lambda: then(pending.wait()), pending)

    def send(self, frames, nbytes, on_sent=None, stop=None, kind=None) -> None:
        if threading.get_ident() == self._thread.ident:  # ``then`` of an ``after``: its turn is now
            self.sender.send(frames, nbytes, on_sent, stop, kind)
        else:
            self._put(lambda: self.sender.send(frames, nbytes, on_sent, stop, kind))

    def _put(self, job, pending: PendingHost | None = None) -> None:
        if self._error is not None:
            raise self._error
        with self._cv:
            self._jobs.append((job, pending))
            self._cv.notify()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._jobs:
                    return
                job, pending = self._jobs.popleft()
            try:
                if pending is not None and not pending.ready():
                    self.overlapped += 1
                job()
            except BaseException as err:  # surfaced on the stage's thread
                self._error = err

    def close(self, drain: bool) -> None:
        """Stop the thread: after the queued sends (``drain``), or dropping them (an aborted run)."""
        with self._cv:
            if not drain:
                self._jobs.clear()
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=30.0)
        if drain and self._error is not None:
            raise self._error
