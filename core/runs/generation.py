"""Text in, text out over a coordinator: tokenize, load the plan, run, stream text pieces.

This is the entry point the CLI and the GUI share. The coordinator works on token ids;
this module owns the tokenizer (on the operator's machine, where the prompts are typed;
the ids go to the source agent only) and turns each step's tokens into text pieces
(``TokenEvent.text``) so every sink sees readable output as it is produced.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from agents.protocol import MAX_LOGIT_BIAS, KvReservation, LinkShape, SamplingSpec, TimelineEvent, TokenEvent
from core.runs.coordinator import (
    MODES,
    Coordinator,
    NullSink,
    RunRequest,
    RunResult,
    RunSink,
)
from core.runs.batching import kv_covers, kv_reservation, run_micro_batches
from core.errors import FormatError, PlanInvalid, RunFailed, UnsupportedModelError
from core.models.checkpoints import check_weight_headers
from core.models.units import load_model_spec
from core.planning.plan import ShardPlan, layout_problems
from core.planning.precision import precision_problems
from core.reporting import NullReporter, Reporter
from core.runs.metrics import RunFigures, compute_figures
from core.runs.recovery import Replanner
from core.runs.run_tokenizer import Encoded, encode_left_padded, load_run_tokenizer, load_tokenizer
from core.runs.text_pieces import TextPieces
from core.runs.weights import ship_stage_weights


def stop_token_ids(model_dir: str, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), else the tokenizer's."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            eos = None
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(e) for e in eos)
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 32
    mode: str = "sequential"
    micro_batches: int | None = None
    """Override of the plan's micro-batch count; None: the plan's (``core.runs.batching``)."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    """HF's repetition_penalty (1 = off; ~1.2 keeps greedy text from looping). On, the last
    stage is sent the prompts' token ids (agents.protocol.SamplingSpec)."""
    no_repeat_ngram_size: int = 0
    """HF's no_repeat_ngram_size (0 = off)."""
    frequency_penalty: float = 0.0
    """OpenAI's frequency_penalty in [-2, 2] (0 = off): counts the tokens generated so far (agents/sampling.py)."""
    presence_penalty: float = 0.0
    """OpenAI's presence_penalty in [-2, 2] (0 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits."""
    dtype: str = "float32"
    threads: int = 0
    links: dict[str, LinkShape] = field(default_factory=dict)
    send_weights: bool = False
    """Send each agent its stage's slice (core.runs.weights) instead of loading ``model_dir``
    from the device's own disk."""
    ignore_eos: bool = False
    """Generate all ``max_new_tokens`` whatever the model emits (the studio's presenter pace: a run
    long enough to watch); the stop tokens are still left out of the text. Greedy tokens equal
    transformers' ``generate`` with no EOS."""


def settings_problem(settings: GenerationSettings) -> tuple[str, str] | None:
    """(field, what is allowed) for the first out-of-range setting, None when all are fine.
    Checked before any work: a NaN temperature must not reach an agent's sampler."""
    s = settings
    if not 1 <= s.max_new_tokens <= 1 << 20:
        return "max-new-tokens", f"must be an integer in [1, {1 << 20}], got {s.max_new_tokens}"
    if s.micro_batches is not None and s.micro_batches > 4096:  # below 1: core.runs.batching says why
        return "micro-batches", f"must be an integer in [1, 4096], got {s.micro_batches}"
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= 100):
        return "temperature", f"must be a finite number in [0, 100], got {s.temperature!r}"
    if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        return "top-p", f"must be a finite number in (0, 1], got {s.top_p!r}"
    if not 0 <= s.seed < 1 << 63:
        return "seed", f"must be an integer in [0, 2**63), got {s.seed}"
    if not (math.isfinite(s.repetition_penalty) and 0 < s.repetition_penalty <= 100):
        return "repetition-penalty", f"must be a finite number in (0, 100] (1 = off), got {s.repetition_penalty!r}"
    if not 0 <= s.no_repeat_ngram_size <= 64:
        return "no-repeat-ngram-size", f"must be an integer in [0, 64] (0 = off), got {s.no_repeat_ngram_size}"
    for name, value in (("frequency-penalty", s.frequency_penalty), ("presence-penalty", s.presence_penalty)):
        if not (math.isfinite(value) and -2 <= value <= 2):
            return name, f"must be a finite number in [-2, 2] (0 = off), got {value!r}"
    if len(s.logit_bias) > MAX_LOGIT_BIAS or any(t < 0 or not (math.isfinite(b) and -100 <= b <= 100)
                                                for t, b in s.logit_bias):
        return "logit-bias", (f"must map at most {MAX_LOGIT_BIAS} token ids >= 0 to biases in [-100, 100], "
                              f"got {s.logit_bias!r}")
    if not 0 <= s.threads <= 1024:
        return "threads", f"must be an integer in [0, 1024], got {s.threads}"
    return None


def sampling_spec(settings: GenerationSettings, seed: int | None = None) -> SamplingSpec:
    """The wire's sampling of ``settings`` (``seed`` overrides theirs): one place that carries every field."""
    s = settings
    return SamplingSpec(temperature=s.temperature, top_p=s.top_p, seed=s.seed if seed is None else seed,
                        repetition_penalty=s.repetition_penalty, no_repeat_ngram_size=s.no_repeat_ngram_size,
                        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                        logit_bias=s.logit_bias)


@dataclass(frozen=True)
class Generation:
    texts: tuple[str, ...]
    result: RunResult
    figures: RunFigures


class _TextSink:
    """Fills ``TokenEvent.text`` before passing tokens on, in step order per micro-batch: agents
    that take turns sampling a batch (attention offloading's staggered replicas) report over
    their own connections, so step k + 1 can overtake step k; it waits for k (``flush``: the
    run ended, whatever is held goes on in step order)."""

    def __init__(self, inner: RunSink, pieces: TextPieces) -> None:
        self.inner = inner
        self.pieces = pieces
        self._next: dict[int, int] = {}
        self._held: dict[int, dict[int, TokenEvent]] = {}
        self._lock = threading.Lock()

    def on_event(self, event: TimelineEvent) -> None:
        self.inner.on_event(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        with self._lock:
            mb = tokens.micro_batch
            if tokens.step < self._next.get(mb, 0):  # a step again (a resumed run): as it comes, as before
                self._emit(tokens)
                return
            held = self._held.setdefault(mb, {})
            held[tokens.step] = tokens
            ready = []
            while self._next.get(mb, 0) in held:
                ready.append(held.pop(self._next.get(mb, 0)))
                self._next[mb] = self._next.get(mb, 0) + 1
            for t in ready:
                self._emit(t)

    def flush(self) -> None:
        with self._lock:
            for mb in sorted(self._held):
                for step in sorted(self._held[mb]):
                    self._emit(self._held[mb][step])
            self._held = {}

    def _emit(self, tokens: TokenEvent) -> None:
        text = tuple(self.pieces.piece(s, t) for s, t in zip(tokens.sequence_ids, tokens.token_ids))
        self.inner.on_tokens(msgspec.structs.replace(tokens, text=text))


def check_run(plan: ShardPlan, model_dir: str, prompts: list[str] | tuple[str, ...],
              settings: GenerationSettings) -> None:
    """Refuse what ``generate`` would refuse before it touches an agent: prompts, settings, the plan's
    layout against the checkpoint's unit count (from config.json alone: no torch, no transformers,
    so an entrance calls it before it starts or connects agents and a bad plan costs milliseconds)."""
    if not prompts:
        raise FormatError("prompts", "no prompt given")
    if settings.mode not in MODES:
        raise FormatError("mode", f"must be one of {', '.join(MODES)}, got {settings.mode!r}")
    problem = settings_problem(settings)
    if problem:
        raise FormatError("run settings", problem[1], problem[0])
    spec = load_model_spec(model_dir)
    problems = layout_problems(plan, spec.num_units) + precision_problems(plan, spec)
    if problems:
        raise PlanInvalid(problems)
    if not any((Path(model_dir) / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise UnsupportedModelError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                                    "(only safetensors checkpoints are supported)")


def generate(
    coordinator: Coordinator,
    plan: ShardPlan,
    model_dir: str,
    prompts: list[str] | tuple[str, ...],
    settings: GenerationSettings,
    *,
    sink: RunSink | None = None,
    reporter: Reporter | None = None,
    load: bool = True,
    replan: Replanner | None = None,
) -> Generation:
    """Load ``plan`` (unless already loaded with a KV reservation that covers this run) and
    generate for ``prompts``; streams into ``sink``. ``replan``: survive a lost device by
    re-planning over the others (``core.runs.recovery``; None: the run fails)."""
    reporter = reporter or NullReporter()
    check_run(plan, model_dir, prompts, settings)
    check_weight_headers(model_dir)  # the weight files' headers, as the agents' reader reads them (no torch)
    tok = load_run_tokenizer(model_dir)
    enc = encode_left_padded(tok, prompts)
    if enc.width == 0:
        raise FormatError("prompts", "a prompt encodes to no tokens")
    stops = stop_token_ids(model_dir, tok)
    # stages reserve the KV cache of this run at load (as the paper's runtime does); a loaded plan
    # whose reservation is too small for this run (longer prompt, more micro-batches) is reloaded
    groups = run_micro_batches(len(prompts), plan, settings.micro_batches)
    kv = kv_reservation(groups, enc.width + settings.max_new_tokens)
    if load or not kv_covers(coordinator.reserved_kv, kv):
        load_plan(coordinator, plan, model_dir, settings, kv=kv, reporter=reporter)
    coordinator.sync_clocks()
    return generate_encoded(coordinator, plan, tok, enc, stops, settings, sink=sink, reporter=reporter,
                            replan=replan)


def load_plan(coordinator: Coordinator, plan: ShardPlan, model_dir: str, settings: GenerationSettings, *,
              kv: KvReservation = KvReservation(), reporter: Reporter | None = None) -> None:
    """Load every stage of ``plan`` as ``settings`` say (dtype, threads, links, weights sent or
    read from the device's disk); ``kv``: the cache each stage reserves (none: it grows).
    ``generate`` loads through it, and so does a server that loads once and serves many runs."""
    reporter = reporter or NullReporter()
    files = None
    if settings.send_weights:
        files = ship_stage_weights(coordinator, plan, model_dir, reporter=reporter).files
    reporter.status(f"loading {len(plan.stages)} stage(s) of {Path(model_dir).name}")
    coordinator.load(plan, model_dir, dtype=settings.dtype, threads=settings.threads, links=settings.links,
                     reporter=reporter, kv=kv, files=files, kind={s.device: s.kind for s in plan.stages})


def generate_encoded(coordinator: Coordinator, plan: ShardPlan, tokenizer, enc, stops: tuple[int, ...],
                     settings: GenerationSettings, *, sink: RunSink | None = None,
                     reporter: Reporter | None = None, replan: Replanner | None = None) -> Generation:
    """One run of already tokenized, left-padded prompts (``enc``: ``input_ids`` and
    ``attention_mask`` tensors) on the loaded ``plan``: a caller that tokenizes itself (a chat
    template, a prompt-length check before queueing) runs through the same path as ``generate``."""
    return _generate_text(tokenizer, enc, stops, settings, lambda request, text_sink: coordinator.run(
        plan, request, text_sink, reporter, replan=replan), sink=sink)


def generate_with(run, model_dir: str, prompts: list[str] | tuple[str, ...], settings: GenerationSettings, *,
                  sink: RunSink | None = None) -> Generation:
    """Generate for ``prompts`` through ``run(request, sink) -> RunResult``: a technique with its own
    run driver (attention offloading's ``run_offload``) gets the same tokenization, stop tokens,
    streamed text and figures as ``generate``."""
    if not prompts:
        raise FormatError("prompts", "no prompt given")
    problem = settings_problem(settings)
    if problem:
        raise FormatError("run settings", problem[1], problem[0])
    tok = load_run_tokenizer(model_dir)
    enc = encode_left_padded(tok, prompts)
    if enc.width == 0:
        raise FormatError("prompts", "a prompt encodes to no tokens")
    return _generate_text(tok, enc, stop_token_ids(model_dir, tok), settings,
                          lambda request, text_sink: run(request, text_sink), sink=sink)


def _generate_text(tok, enc, stops, settings: GenerationSettings, run, *, sink: RunSink | None = None) -> Generation:
    if not isinstance(enc, Encoded):  # a caller's own tensors (generate_encoded)
        enc = Encoded(tuple(tuple(r) for r in enc["input_ids"].tolist()),
                      tuple(tuple(r) for r in enc["attention_mask"].tolist()))
    pieces = TextPieces(tok, len(enc.input_ids), stops, settings.max_new_tokens,
                        stop_ends=not settings.ignore_eos)
    request = RunRequest(
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        max_new_tokens=settings.max_new_tokens,
        mode=settings.mode,  # type: ignore[arg-type]
        micro_batches=settings.micro_batches,
        eos_token_ids=() if settings.ignore_eos else stops,
        pad_token_id=int(tok.pad_token_id or 0),
        sampling=sampling_spec(settings),
    )
    text_sink = _TextSink(sink or NullSink(), pieces)
    try:
        result = run(request, text_sink)
    finally:
        text_sink.flush()
    texts = tuple(tok.decode([t for t in seq if t not in stops], skip_special_tokens=True) for seq in result.tokens)
    return Generation(texts=texts, result=result, figures=compute_figures(result.events, result.token_events))


def generation_json(out: Generation, run_id: int | None, mode: str) -> dict:
    """What a language model's run verb prints with ``--json`` (``edgeshard.run-output``, docs/formats.md):
    every sequence's generated token ids and text, the run's figures, its recoveries and recorded run."""
    return {"format": "edgeshard.run-output", "version": 1, "mode": mode, "texts": list(out.texts),
            "tokens": [list(t) for t in out.result.tokens], "figures": msgspec.to_builtins(out.figures),
            "recoveries": [{"failed": r.failed, "step": r.step, "old_stages": list(r.old_stages),
                            "new_stages": list(r.new_stages)} for r in out.result.recoveries],
            "run_id": run_id}


__all__ = ["Generation", "GenerationSettings", "generation_json", "RunFailed", "generate", "generate_encoded", "generate_with", "load_plan",
           "load_run_tokenizer", "load_tokenizer", "stop_token_ids", "TextPieces"]
