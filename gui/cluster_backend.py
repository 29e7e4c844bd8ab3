"""The Run screen's backend over live agents: load the current plan, tokenize, run, stream.

Implements ``gui.run_panel.RunBackend`` with a ``core.coordinator.Coordinator``. The
plan is (re)loaded onto the agents only when it changed since the last run. Token ids
are decoded to text here (the tokenizer lives with the operator, not the agents), so
the monitor can stream the generated text.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.coordinator import Coordinator, RunRequest
from core.errors import EdgeShardError, RunFailed
from core.plan import ShardPlan
from core.reporting import Reporter


class _DecodingSink:
    """Forwards events; fills each TokenEvent's text from the tokenizer."""

    def __init__(self, sink, tokenizer) -> None:
        self.sink, self.tokenizer = sink, tokenizer

    def on_event(self, event: TimelineEvent) -> None:
        self.sink.on_event(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        if not tokens.text:
            text = tuple(self.tokenizer.decode([t], skip_special_tokens=True) for t in tokens.token_ids)
            tokens = msgspec.structs.replace(tokens, text=text)
        self.sink.on_tokens(tokens)


class ClusterRunBackend:
    def __init__(self, coordinator: Coordinator, state) -> None:
        self.coordinator = coordinator
        self.state = state
        """The StudioState whose plan is run (read on the worker: plans are immutable values)."""
        self._loaded: tuple[ShardPlan, str] | None = None
        self._tokenizers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def lanes(self) -> list[str]:
        plan = self.state.plan
        return list(plan.devices()) if plan is not None else list(self.coordinator.endpoints)

    def _tokenizer(self, model_dir: str):
        with self._lock:
            if model_dir not in self._tokenizers:
                from transformers import AutoTokenizer

                try:
                    tok = AutoTokenizer.from_pretrained(model_dir)
                except (OSError, ValueError) as err:
                    raise EdgeShardError(f"cannot read the tokenizer in {model_dir}: {err}") from None
                tok.padding_side = "left"
                self._tokenizers[model_dir] = tok
            return self._tokenizers[model_dir]

    def run(self, settings, sink, reporter: Reporter) -> Any:
        plan = self.state.plan
        problem = self.state.problem
        if plan is None:
            raise EdgeShardError("no plan to run: make one on the Plan screen (Auto-solve) first")
        if problem is not None:
            from core.cost import structural_violations

            bad = structural_violations(problem, plan)
            if bad:
                raise EdgeShardError("the plan cannot run: " + "; ".join(bad))
        model_dir = settings.model_dir or getattr(self.state, "model_path", "")
        if not model_dir:
            raise EdgeShardError("choose the model checkpoint directory first")
        tok = self._tokenizer(model_dir)
        if self._loaded != (plan, model_dir):
            reporter.status("checking the agents")
            # a busy agent (still importing torch, or on a loaded machine) may take a while to answer
            self.coordinator.wait_ready(60.0)
            reporter.status(f"loading {len(plan.stages)} stage(s) onto the agents")
            self.coordinator.load(plan, model_dir, reporter=reporter)
            self._loaded = (plan, model_dir)
        enc = tok(list(settings.prompts), padding=True)
        k = 1 if settings.mode == "sequential" else max(1, min(settings.micro_batches, len(settings.prompts)))
        eos = tok.eos_token_id
        request = RunRequest(
            input_ids=tuple(tuple(r) for r in enc["input_ids"]),
            attention_mask=tuple(tuple(r) for r in enc["attention_mask"]),
            max_new_tokens=settings.max_new_tokens, mode=settings.mode, micro_batches=k,
            eos_token_ids=(eos,) if eos is not None else (), pad_token_id=tok.pad_token_id or 0,
        )
        try:
            result = self.coordinator.run(plan, request, _DecodingSink(sink, tok), reporter)
        except RunFailed:
            self._loaded = None if reporter.cancel_requested() is False else self._loaded
            raise
        return {"run_id": result.run_id, "wall_s": result.wall_s,
                "texts": [tok.decode(list(t), skip_special_tokens=True) for t in result.tokens]}

    def stop(self) -> None:
        self.coordinator.stop()
