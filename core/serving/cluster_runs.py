"""Requests become runs of the cluster: the same coordinator, generation path and recording as
``edgeshard run``, with the plan loaded once.

``ServedModel`` owns what a server keeps between requests: the coordinator (its agents hold
the loaded plan), the tokenizer, the stop tokens, the run settings the server was started
with, and the workspace session its requests are recorded in. ``admit`` turns a parsed body
into a ``ServedRequest`` (the chat template applied, the prompt tokenized, its length checked
against the model's context: 413); ``run_batch`` runs a batch of them as one generation
(``core.runs.generation.generate_encoded``: the run state machine, the recovery path with
``--on-failure replan``), hands each its tokens, and records each as its own run (its prompt,
parameters, tokens, figures, and the timeline events of the run it rode in), listed by
``edgeshard sessions`` and replayable like any run.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.errors import EdgeShardError, RunFailed
from core.planning.plan import ShardPlan
from core.runs.batching import batching_settings
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings, generate_encoded, load_plan, stop_token_ids
from core.runs.recovery import Replanner
from core.serving.openai_api import ApiError, ParsedRequest, plain_chat_prompt, unavailable
from core.serving.served import ServedRequest
from core.sessions.recording import RunRecorder
from core.sessions.store import SessionStore

log = logging.getLogger(__name__)



def model_context(model_dir: str) -> int:
    """Tokens the model can attend over (prompt + generated): its config's position limit."""
    import json

    config = json.loads(Path(model_dir, "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(config.get(key), int):
            return int(config[key])
    text = config.get("text_config") or {}
    return int(text.get("max_position_embeddings", 2048))


class _BatchSink:
    """The run's stream, split per request: each request gets its own tokens (and records them as
    sequence 0 of its own run); every request's recording gets the run's timeline events."""

    def __init__(self, batch: list[ServedRequest], recorders: list[RunRecorder | None], on_all_done) -> None:
        self.batch, self.recorders, self._on_all_done = batch, recorders, on_all_done
        self._ended = False
        self._lock = threading.Lock()

    def on_event(self, event: TimelineEvent) -> None:
        for rec in self.recorders:
            if rec is not None:
                rec.on_event(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        for seq, token in zip(tokens.sequence_ids, tokens.token_ids):
            text = self.batch[seq].take(token) if seq < len(self.batch) else None
            if text is None:
                continue
            rec = self.recorders[seq]
            if rec is not None:
                rec.on_tokens(msgspec.structs.replace(tokens, sequence_ids=(0,), token_ids=(token,), text=(text,)))
        self.end_if_all_done()

    def end_if_all_done(self) -> None:
        """Every request of the run is done (stop strings, own max_tokens, clients gone): stop the run."""
        with self._lock:
            if self._ended or not all(r.done for r in self.batch):
                return
            self._ended = True
        self._on_all_done()


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs every request (``edgeshard serve``'s run options)."""

    generation: GenerationSettings
    """mode, micro-batches, dtype, threads, links, send_weights (its sampling fields are per request)."""
    max_tokens: int = 32
    """A request's max_tokens when it gives none (capped by the context left after its prompt)."""


class ServedModel:
    """The loaded plan and everything a request needs; one run on the cluster at a time."""

    def __init__(self, coordinator: Coordinator, plan: ShardPlan, model_dir: str, name: str, tokenizer,
                 settings: ServeSettings, *, replan: Replanner | None = None, store: SessionStore | None = None,
                 session_id: int | None = None) -> None:
        self.coordinator, self.plan, self.model_dir, self.name = coordinator, plan, model_dir, name
        self.tokenizer = tokenizer
        self.settings = settings
        self.replan = replan
        self.store, self.session_id = store, session_id
        self.plan_id = store.add_plan(session_id, plan) if store is not None else None
        self.stop_ids = stop_token_ids(model_dir, tokenizer)
        self.context = model_context(model_dir)
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.loaded = False
        self._current: list[ServedRequest] | None = None
        """The batch whose run is going (``stop_running`` stops only that one)."""
        self._current_lock = threading.Lock()

    # ------------------------------------------------------------------ loading
    def load(self, reporter=None) -> None:
        """Load the plan on its agents once (no KV reservation: stages grow their cache to each run)."""
        load_plan(self.coordinator, self.plan, self.model_dir, self.settings.generation, reporter=reporter)
        self.coordinator.sync_clocks()  # later runs keep the estimates fresh from the heartbeats' own samples
        self.loaded = True

    def unload(self) -> None:
        if self.loaded:
            try:
                self.coordinator.unload()
            except EdgeShardError as err:
                log.warning("unloading: %s", err)
            self.loaded = False

    def _ready(self) -> str | None:
        """None when the plan is loaded (loading it again after a failure unloaded it), else why not."""
        if not self.loaded:
            lost = [d for d in self.plan.devices() if self.coordinator.link.is_lost(d)]
            if lost:
                return f"agent {lost[0]} is not answering; restart it (the plan is loaded again on the next request)"
            try:
                self.load()
            except EdgeShardError as err:
                return f"the plan could not be loaded again ({err}); restart the lost agent"
        return None

    # ------------------------------------------------------------------ admission
    def admit(self, parsed: ParsedRequest, deliver) -> ServedRequest:
        """A ``ServedRequest`` for ``parsed``: prompt rendered and tokenized, its length checked (413)."""
        if parsed.model != self.name:
            raise ApiError(404, f"the model {parsed.model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")
        tok = self.tokenizer
        if parsed.kind == "chat" and self.chat_template:
            try:
                text = tok.apply_chat_template([{"role": r, "content": c} for r, c in parsed.messages],
                                               add_generation_prompt=True, tokenize=False)
            except Exception as err:  # the template's own rules (e.g. alternating roles) refused them
                raise ApiError(400, f"the model's chat template refused these messages: {err}",
                               param="messages", code="invalid_value") from None
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = parsed.prompt if parsed.kind == "completion" else plain_chat_prompt(parsed.messages)
            ids = tok(text)["input_ids"]
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_value")
        room = self.context - len(ids)
        asked = parsed.sampling.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise ApiError(413, f"the prompt has {len(ids)} tokens and asks for {asked or 1} more; the model's "
                                f"context is {self.context} tokens", param="messages" if parsed.kind == "chat"
                           else "prompt", code="context_length_exceeded")
        max_tokens = asked if asked is not None else min(self.settings.max_tokens, room)
        seed = parsed.sampling.seed if parsed.sampling.seed is not None else secrets.randbelow(1 << 62)
        prefix = "cmpl-" if parsed.kind == "completion" else "chatcmpl-"
        return ServedRequest(prefix + secrets.token_hex(12), parsed, text, tuple(ids), max_tokens, seed, tok,
                             self.stop_ids, deliver)

    # ------------------------------------------------------------------ runs
    def stop_running(self, batch: list[ServedRequest]) -> None:
        """End ``batch``'s run early (every request in it is done, or the server stops); never
        another batch's run, which may have started since the caller looked."""
        with self._current_lock:
            if self._current is batch:
                self.coordinator.stop()

    def run_batch(self, batch: list[ServedRequest]) -> None:
        """Run ``batch`` as one generation; every request ends (finished, failed, or cancelled)."""
        import torch

        started = time.perf_counter()
        for r in batch:
            r.started_s = started
        live = [r for r in batch if not r.done]
        why = self._ready() if live else "every request left before its run"
        if why is not None:
            for r in batch:
                r.fail(unavailable(why))
            return
        width = max(len(r.prompt_ids) for r in batch)
        pad = int(self.tokenizer.pad_token_id or 0)
        enc = {"input_ids": torch.tensor([[pad] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in batch]),
               "attention_mask": torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                                               for r in batch])}
        s = batch[0].parsed.sampling
        settings = replace(self.settings.generation, max_new_tokens=max(r.max_tokens for r in batch),
                           temperature=s.temperature, top_p=s.top_p, seed=batch[0].seed,
                           repetition_penalty=s.repetition_penalty, no_repeat_ngram_size=s.no_repeat_ngram_size)
        recorders = [self._record(r, batch, settings) for r in batch]
        sink = _BatchSink(batch, recorders, lambda: self.stop_running(batch))
        failure: ApiError | None = None
        try:
            with self._current_lock:
                self._current = batch
            if all(r.done for r in batch):  # every client left before the run started
                return
            out = generate_encoded(self.coordinator, self.plan, self.tokenizer, enc, self.stop_ids, settings,
                                   sink=sink, replan=self.replan)
            if out.result.plan is not None:
                self.plan = out.result.plan  # re-planned around a lost device: later runs use the new plan
        except RunFailed as err:
            if not all(r.done for r in batch):
                failure = unavailable(str(err))
                self.loaded = self.coordinator.is_loaded(self.plan, self.model_dir)
        except EdgeShardError as err:
            failure = ApiError(500, str(err), type="server_error")
        except Exception as err:  # a bug: the request fails, the server stays up (and says so in its log)
            log.exception("a run failed")
            failure = ApiError(500, f"internal error: {err}", type="server_error")
        finally:
            with self._current_lock:
                self._current = None
            for r, rec in zip(batch, recorders):
                if failure is not None:
                    r.fail(failure)
                r.run_ended()
                if rec is not None:
                    status = ("stopped" if r.cancelled else "failed" if r.failed is not None else "completed")
                    rec.finish(status, r.figures())

    def _record(self, r: ServedRequest, batch: list[ServedRequest], settings: GenerationSettings):
        if self.store is None:
            return None
        p = r.parsed
        record = {
            "model_dir": self.model_dir, "prompts": [r.prompt_text], "lanes": list(self.plan.devices()),
            "started_by": "edgeshard serve", "request_id": r.id,
            "endpoint": "/v1/completions" if p.kind == "completion" else "/v1/chat/completions",
            "messages": [list(m) for m in p.messages] if p.kind == "chat" else None,
            "max_new_tokens": r.max_tokens, "mode": settings.mode, "temperature": settings.temperature,
            "top_p": settings.top_p, "seed": r.seed, "stop": list(p.sampling.stop), "stream": p.stream,
            "repetition_penalty": settings.repetition_penalty,
            "no_repeat_ngram_size": settings.no_repeat_ngram_size, "dtype": settings.dtype,
            "prompt_tokens": len(r.prompt_ids), "batch": [b.id for b in batch],
            **batching_settings(self.plan, settings.micro_batches),
        }
        run_id = self.store.create_run(self.session_id, model=self.name, mode=settings.mode, kind="measured",
                                       plan_id=self.plan_id, settings=record)
        return RunRecorder(self.store, run_id)
