"""One request while it is served: its prompt's tokens, the tokens it got, and what its client is sent.

A request rides in a batch (one run of the cluster, several requests as its sequences); the
run's token callbacks hand each request its own tokens (``take``), and the request decides
alone when it is done: a stop token, a stop string, its own ``max_tokens``, its client gone.
What its client should see goes out through ``deliver`` (thread-safe: the HTTP side's queue),
as ``Joined`` (its join was sent), ``Piece``, then ``Finished`` or ``Failed``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.runs.generation import TextPieces
from core.serving.openai_api import ApiError, ParsedRequest, StopText


@dataclass(frozen=True)
class Joined:
    """The request's join is on its way to the stages: a stream's headers can go out (its status is known)
    while the prefill runs, so the first token's event is the only write left on its path."""


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str
    """OpenAI's finish_reason: ``stop`` (a stop token or string) or ``length`` (max_tokens)."""
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ApiError


Delivery = Joined | Piece | Finished | Failed


class ServedRequest:
    """A request from admission to its end; ``take`` runs on the coordinator's IO thread."""

    def __init__(self, request_id: str, parsed: ParsedRequest, prompt_text: str, prompt_ids: tuple[int, ...],
                 max_tokens: int, seed: int, tokenizer, stop_ids: tuple[int, ...],
                 deliver: Callable[[Delivery], None]) -> None:
        self.id = request_id
        self.parsed = parsed
        self.prompt_text = prompt_text
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.seed = seed
        self._deliver = deliver
        self._stop_ids = set(stop_ids)
        self._pieces = TextPieces(tokenizer, 1, stop_ids, max_tokens)
        self._stop_text = StopText(parsed.sampling.stop)
        self._lock = threading.Lock()
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.failed: ApiError | None = None
        self.cancelled = False
        self.arrived_s = time.perf_counter()
        self.started_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.sequence_id: int | None = None
        self.resumed = False
        """Joined again after a failure (its micro-batch takes no new rows)."""
        """Its sequence in the open run (the tokens' id), once it joined."""
        self.joined_at: float | None = None
        """When it first joined the run (``time.time()``): its recorded timeline counts from here."""
        self.ended_at: float | None = None
        """When it was done (``time.time()``): events of its micro-batch after it are not its."""
        self.checked_s = 0.0
        """When the HTTP side last checked that the client is still there (its event loop's clock)."""

    @property
    def batch_key(self) -> tuple | None:
        """Requests with equal keys may share a join (one sampling for its rows). Greedy ones with the
        same repetition controls, penalties and logit bias do; a sampled one joins alone (its own seed and step count). Any
        join may then be rows of a running micro-batch: each row samples by its own join's."""
        s = self.parsed.sampling
        if s.temperature > 0:
            return None
        return ("greedy", s.repetition_penalty, s.no_repeat_ngram_size, s.frequency_penalty, s.presence_penalty,
                s.logit_bias)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.failed is not None or self.cancelled

    def take(self, token: int) -> str | None:
        """One generated token: the text it adds to the answer (before stop strings cut it), or None
        when the request was already done (the token is not its)."""
        with self._lock:
            if self.done:
                return None
            now = time.perf_counter()
            self.first_token_s = self.first_token_s or now
            self.last_token_s = now
            self.tokens.append(token)
            piece = self._pieces.piece(0, token)
            out = self._stop_text.feed(piece)
            if self._stop_text.hit:
                self._finish("stop", out)
            elif token in self._stop_ids:
                self._finish("stop", out + self._stop_text.flush())
            elif len(self.tokens) >= self.max_tokens:
                self._finish("length", out + self._stop_text.flush())
            elif out or len(self.tokens) == 1:  # the first token goes out even without text yet: a
                self._send(Piece(out))            # stream starts (and its TTFT is) when generation does
            return piece

    def joined(self) -> None:
        """Its join was sent to the run (its first join: not when it is resumed after a failure)."""
        with self._lock:
            if not self.done:
                self._deliver(Joined())

    def fail(self, error: ApiError) -> None:
        with self._lock:
            if not self.done:
                self.failed = error
                self._deliver(Failed(error))

    def cancel(self) -> None:
        """The client went away: nothing more is sent, and the run may end early."""
        with self._lock:
            self.cancelled = True

    def _finish(self, reason: str, last: str) -> None:
        if last:
            self._send(Piece(last))
        self.finish_reason = reason
        self._deliver(Finished(reason, len(self.prompt_ids), len(self.tokens)))

    def _send(self, piece: Piece) -> None:
        self.text += piece.text
        self._deliver(piece)

    def figures(self) -> dict:
        """What a recorded request adds to its run's figures: its own view of the wait and the tokens."""
        out: dict = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.tokens),
                     "finish_reason": self.finish_reason}
        if self.started_s is not None:
            out["queue_s"] = self.started_s - self.arrived_s
        if self.first_token_s is not None:
            out["server_ttft_s"] = self.first_token_s - self.arrived_s
        if self.first_token_s is not None and len(self.tokens) > 1:
            out["server_tpot_s"] = (self.last_token_s - self.first_token_s) / (len(self.tokens) - 1)
        return out
