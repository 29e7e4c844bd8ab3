"""The stage run: one run on one stage, the same for every stage kind.

Every stage performs a step by executing ``agents.schedule.step_operations`` (receive, compute,
send): the schedule is written there once, and the simulator times the same operations. The
source stage (stage 0) also drives the run: it holds the prompts' token ids (they never leave
it), starts prefill and decode steps per micro-batch as ``agents.schedule`` decides for the mode,
and receives the sampled tokens back from the last stage. A run whose ``StartRun.options`` have a
registered run driver is scheduled by that driver instead (``agents.registry.run_driver_for``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field

import torch
import zmq

from agents.boundary_copy import OrderedSends, PendingHost, overlap_wanted
from agents.protocol import (
    DataHeader,
    LinkShape,
    LoadShard,
    PeerSpec,
    RunFinished,
    SamplingSpec,
    StartRun,
    TokensProduced,
)
from agents.sampling import greedy_tokens, step_generator
from agents.schedule import (
    Compute,
    Receive,
    Send,
    SourceState,
    Step,
    begin,
    on_returned,
    phase_of,
    step_operations,
)
from agents.stage_input import ReservationExceeded, StageInputError
from agents.transport import LinkSender, RunAborted, data_message, tensor_frame, tensor_from_frame

MAX_DATA_BYTES = 1 << 30
NOT_DEFERRED = contextlib.nullcontext()
"""A step whose output is not copied from a GPU (reusable: it holds nothing)."""


def default_sampler(spec: SamplingSpec):
    """Build ``(sample_fn, make_generator)`` from agents.sampling for a run."""
    from agents.sampling import SamplingParams, sample

    wanted = {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k, "seed": spec.seed,
              "repetition_penalty": spec.repetition_penalty, "no_repeat_ngram_size": spec.no_repeat_ngram_size,
              "frequency_penalty": spec.frequency_penalty, "presence_penalty": spec.presence_penalty,
              "logit_bias": spec.logit_bias}
    accepted = SamplingParams.__struct_fields__  # inspect.signature of a Struct: ~0.7 ms, per join at the last stage
    params = SamplingParams(**{k: v for k, v in wanted.items() if k in accepted})
    if params.greedy and not spec.uses_history and not spec.logit_bias:  # what ``sample`` does then, sooner
        return lambda logits, gen, history=None, prompt_length=0: greedy_tokens(logits)
    return lambda logits, gen, history=None, prompt_length=0: sample(logits, params, gen, history, prompt_length)


@dataclass
class _Group:
    """Source-side state of one micro-batch."""

    index: int
    seq_ids: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    last: torch.Tensor | None = None
    done: bool = False


@dataclass
class Loaded:
    """A loaded stage: its LoadShard, its executor and the link to the next stage."""

    msg: LoadShard
    executor: object
    next_peer: PeerSpec | None
    link: LinkShape
    source_device: str
    push: zmq.Socket | None = None
    sender: LinkSender | None = None

    @property
    def next_device(self) -> str:
        return self.next_peer.device if self.next_peer else ""


class StageRun:
    """One run on one stage: executes ``agents.schedule``'s operations for each step it
    receives (or, on the source, starts), and on the source follows the schedule."""

    def __init__(self, agent, loaded: Loaded, msg: StartRun, stop: threading.Event) -> None:
        self.agent = agent
        self.stop = stop
        self.ex = loaded.executor
        self.copies = getattr(loaded.executor, "boundary", None)
        """A GPU stage's pinned copies (agents.boundary_copy): its outputs are sent, in order, by a thread of
        their own once copied, while this one computes the next step (not on the last stage: it samples)."""
        if self.copies is not None and loaded.sender is not None and not self.is_last_of(loaded) and overlap_wanted():
            loaded = dataclasses.replace(loaded, sender=OrderedSends(loaded.sender))
        else:
            self.copies = None
        self.loaded = loaded
        self.msg = msg
        self.stage = loaded.msg.stage
        self.n_stages = len(loaded.msg.peers)
        self.units = (loaded.msg.start, loaded.msg.end)
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.n_stages - 1
        self.clock = agent.clock
        self.seen_groups: set[int] = set()
        self.eos = frozenset(msg.eos_token_ids)
        self.sample = agent.sampler_factory(msg.sampling) if self.is_last else None
        self.histories: dict[int, torch.Tensor] = {}
        """Last stage, when the sampler needs them: per micro-batch, each sequence's tokens so far
        (the padded prompt, then every token sampled), as HF's ``input_ids``."""
        if self.is_last and msg.sampling.uses_history:
            if not msg.input_ids:
                raise ValueError("a repetition penalty or n-gram ban needs the prompts' token ids at the last stage")
            ids = torch.tensor(msg.input_ids, dtype=torch.int64)
            self.histories = {g: ids[list(seqs)] for g, seqs in enumerate(msg.micro_batches)}
        self.groups: dict[int, _Group] = {}
        self.source: SourceState | None = None
        self.injections: collections.deque[Step] = collections.deque()
        """Steps the schedule started but this source has not computed yet. The execute loop
        runs them, so a one-stage plan (first and last at once) loops per token instead of recursing."""
        self.wait_started = self.clock()
        self.own_spans = bool(getattr(self.ex, "records_own_spans", False))
        """The executor records its compute spans itself (read once, not per step)."""
        self.take_events = getattr(self.ex, "take_events", None)
        """An executor's own events (expert reads, ...), taken after each compute."""

    @staticmethod
    def is_last_of(loaded: Loaded) -> bool:
        return loaded.msg.stage == len(loaded.msg.peers) - 1

    # ---------------------------------------------------------------- main loop
    def execute(self) -> None:
        finished = False
        try:
            with torch.inference_mode():  # once for the run, not per step (a step's own enter and exit: ~2 µs)
                self._execute()
            finished = True
        finally:
            if self.copies is not None:  # a finished source's sends are all out; an aborted run's are dropped
                self.loaded.sender.close(drain=finished)

    def _execute(self) -> None:
        if self.is_first:
            self._setup_groups()
            self.source, started = begin(self.msg.mode, len(self.groups), self.msg.max_new_tokens)
            self.injections.extend(started)
            self._run_injections()
            if self.source.all_finished:
                self._finish()
                return
            self.wait_started = self.clock()
        stop = self.stop
        while not stop.is_set():
            received = self.agent.receive_data(MAX_DATA_BYTES, timeout_ms=None)  # a stop wakes it (DataInbox)
            if received is not None and self._on_data(*received):
                self._finish()
                return
            self.wait_started = self.clock()
        raise RunAborted()

    def _on_data(self, header: DataHeader, bufs, got: float) -> bool:
        """One received data message of any run: performed (or dropped); True when this source's
        run is finished by it."""
        if header.run_id != self.msg.run_id or header.kind == "probe":
            return False  # a straggler of an earlier run, or a link probe
        problem = self._frame_problem(header)
        if problem:
            self.agent._log(f"dropped data message from {header.sender!r}: {problem}")
            return False
        self.agent._event("recv_wait", header.phase, header.step, header.micro_batch, self.wait_started, got)
        tensors = [tensor_from_frame(s, b) for s, b in zip(header.tensors, bufs)]
        if header.kind == "tokens":
            self._on_tokens(header.micro_batch, header.step, tensors[0], got)
            self._run_injections()
            self.agent._wake_for_outbox()
            return self.source.all_finished
        step = Step(header.micro_batch, header.step)
        mask = tensors[1] if len(tensors) > 1 else None  # a prefill's, or a step that adds rows (open runs)
        try:
            self._perform(step, tensors[0], mask)
        except ReservationExceeded:
            raise  # the run is larger than this load: it fails (RunError), nothing to drop
        except StageInputError as err:  # a frame this stage cannot run: dropped, the run goes on
            self.agent._log(f"dropped data message from {header.sender!r}: {err}")
        return False

    def _frame_problem(self, header: DataHeader) -> str:
        """Why a decoded frame of this run cannot be used here ("" when it can): checked before
        any compute, so a lying or broken peer costs a log line, not the run."""
        if header.kind == "tokens":
            if not self.is_first:
                return "token ids sent to a stage that is not the source"
            g = self.groups.get(header.micro_batch)
            if g is None:
                return f"tokens for unknown micro-batch {header.micro_batch}"
            started = self.source.started[g.index]
            if header.step != started or self.source.returned[g.index] >= header.step:
                return f"tokens for step {header.step} of micro-batch {g.index}, expected step {started}"
            if len(header.tensors) != 1 or header.tensors[0].dtype != "int64":
                return "tokens must be one int64 tensor"
            n = 1
            for d in header.tensors[0].shape:
                n *= d
            if n != len(g.seq_ids):
                return f"{n} token ids for a micro-batch of {len(g.seq_ids)} sequences"
            return ""
        if self.is_first:
            return "hidden states sent to the source stage"
        if header.phase != phase_of(header.step):
            return f"phase {header.phase!r} does not match step {header.step}"
        want = 2 if header.step == 0 else 1
        if len(header.tensors) != want:
            return f"{header.phase} needs {want} tensors, got {len(header.tensors)}"
        return ""

    def drop_all(self) -> None:
        for g in sorted(self.seen_groups):
            try:
                self.ex.drop(g)
            except Exception:
                pass
        self.seen_groups.clear()

    # ------------------------------------------------------ one step's operations
    def _perform(self, step: Step, x: torch.Tensor, mask) -> None:
        """Execute this stage's operations of ``step`` (its Receive, if any, is what
        brought ``x`` here)."""
        for op in step_operations(self.stage, self.n_stages, self.units, step):
            if isinstance(op, Compute):
                x = self._compute(op, x, mask)
            elif isinstance(op, Send):
                self._send(op, x, mask)
            elif not isinstance(op, Receive):
                raise TypeError(f"unknown schedule operation {op!r}")
        if self.is_first and self.is_last:  # one stage: the sampled tokens are already here
            self._on_tokens(step.micro_batch, step.step, x, self.clock())

    def _compute(self, op: Compute, x: torch.Tensor, mask) -> torch.Tensor:
        mb = op.micro_batch
        self.seen_groups.add(mb)
        t0 = self.clock()
        deferred = self.copies.deferred() if self.copies is not None and not op.samples else NOT_DEFERRED
        with deferred:  # in inference mode: ``execute``
            out = self._forward(op, x, mask)
            if op.samples:
                history = self.histories.get(mb)
                out = self.sample(out, self._generator(mb, op.step), history, self._prompt_length(mb)).to(torch.int64)
                if history is not None:
                    self.histories[mb] = torch.cat([history, out.view(-1, 1)], dim=1)
        if not self.own_spans:
            self.agent._event("compute", op.phase, op.step, mb, t0, self.clock())
        take_events = self.take_events
        if take_events is not None:
            for kind, start, end, nbytes, peer in take_events():
                self.agent._event(kind, op.phase, op.step, mb, self.clock.at(start), self.clock.at(end), nbytes, peer)
        return out

    def _forward(self, op: Compute, x: torch.Tensor, mask) -> torch.Tensor:
        """The executor's part of a step: a prefill (step 0) or a one-token decode step."""
        return self.ex.prefill(op.micro_batch, x, mask) if op.step == 0 else self.ex.decode(op.micro_batch, x)

    def _prompt_length(self, mb: int) -> int:
        """Where micro-batch ``mb``'s generated tokens start in its history: a resumed one's prompt
        already ends with its tokens so far (``StartRun.first_steps``), which the penalties count."""
        msg = self.msg
        width = len(msg.input_ids[0]) if msg.input_ids else 0
        return width - (msg.first_steps[mb] if mb < len(msg.first_steps) else 0)

    def _generator(self, mb: int, step: int) -> torch.Generator:
        """The draw of ``step`` keyed by its place in the whole generation (``StartRun.first_steps``)."""
        msg = self.msg
        key = msg.micro_batch_keys[mb] if mb < len(msg.micro_batch_keys) else mb
        first = msg.first_steps[mb] if mb < len(msg.first_steps) else 0
        return step_generator(msg.sampling.seed, key, first + step)

    def _send(self, op: Send, out: torch.Tensor, mask) -> None:
        if isinstance(out, PendingHost):  # still copying to the host: sent by the sending thread once it is
            self.loaded.sender.after(out, lambda host: self._send(op, host, mask))
            return
        mb, step, phase = op.micro_batch, op.step, op.phase
        tensors = [out]
        if op.payload == "hidden" and mask is not None:
            tensors.append(mask.to(torch.int64))
        specs, bufs = zip(*(tensor_frame(t) for t in tensors))
        header = DataHeader(
            run_id=self.msg.run_id,
            kind=op.payload,
            phase=phase,
            step=step,
            micro_batch=mb,
            sender=self.agent.device,
            tensors=tuple(specs),
            t_sent=self.clock(),
        )
        nbytes = sum(s.nbytes() for s in specs)
        peer = self.loaded.next_device
        agent = self.agent

        def on_sent(start: float, end: float, n: int) -> None:
            agent._event("send", phase, step, mb, start, end, n, peer)

        self.loaded.sender.send(data_message(header, list(bufs)), nbytes, on_sent, self.stop, kind=op.payload)

    # ------------------------------------------------------------ the source's part
    def _setup_groups(self) -> None:
        ids = torch.tensor(self.msg.input_ids, dtype=torch.int64)
        mask = torch.tensor(self.msg.attention_mask, dtype=torch.int64)
        for g, seqs in enumerate(self.msg.micro_batches):
            idx = list(seqs)
            before = [list(self.msg.generated[i]) if self.msg.generated else [] for i in idx]
            eos = self.eos
            self.groups[g] = _Group(
                index=g,
                seq_ids=tuple(seqs),
                input_ids=ids[idx],
                attention_mask=mask[idx],
                tokens=before,
                finished=[bool(t) and (t[-1] in eos or len(t) >= self.msg.max_new_tokens) for t in before],
            )

    def _run_injections(self) -> None:
        """Perform the started steps in order; on a one-stage plan each one starts the
        next through ``_on_tokens``, so this drains a whole run (checking for a stop per step)."""
        while self.injections and not self.stop.is_set():
            step = self.injections.popleft()
            g = self.groups[step.micro_batch]
            self._perform(step, *self._step_input(g, step))
            self.agent._wake_for_outbox()  # the tokens that started this step go out now

    def _step_input(self, g: _Group, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the source feeds ``step`` of ``g`` (and its mask): the prompts, then the last tokens."""
        return (g.input_ids, g.attention_mask) if step.step == 0 else (g.last.view(-1, 1), None)

    def _on_tokens(self, mb: int, step: int, ids: torch.Tensor, t: float) -> None:
        g = self.groups[mb]
        got = ids.reshape(-1).tolist()  # once: the loop and the message read the same ints
        eos = self.eos
        fed = []
        running = not any(g.finished)  # every row is fed its token: the received ids are the next input
        for i, tok in enumerate(got):
            if g.finished[i]:
                fed.append(self.msg.pad_token_id)
                continue
            g.tokens[i].append(tok)
            fed.append(tok)
            if self._sequence_done(g, i, tok, eos):
                g.finished[i] = True
        # (the received frame's memory, owned by this tensor: ~10 µs a step less than building one from ints)
        g.last = ids.reshape(-1) if running else torch.tensor(fed, dtype=torch.int64)
        g.done = all(g.finished)
        # Not woken here: the next step starts first (its compute and send are the hot
        # path); ``_run_injections`` wakes the control thread once it is under way. The
        # token's time ``t`` is its arrival, so figures do not move.
        self.agent._post(
            TokensProduced(
                run_id=self.msg.run_id,
                micro_batch=mb,
                step=step,
                sequence_ids=g.seq_ids,
                token_ids=tuple(got),
                t=t,
            ),
            wake=False,
        )
        self.source, started = on_returned(self.source, mb, step, finished_early=self._ends(g))
        self.injections.extend(started)

    def _ends(self, g: _Group) -> bool:
        """Whether ``g`` takes no more steps once its tokens are back (an open run may add rows to it)."""
        return g.done

    def _sequence_done(self, g: _Group, i: int, token: int, eos: set[int]) -> bool:
        """Whether sequence ``i`` of ``g`` is finished by ``token`` (an open run adds its own budgets)."""
        return token in eos or len(g.tokens[i]) >= self.msg.max_new_tokens

    def _finish(self) -> None:
        tokens: dict[int, list[int]] = {}
        for g in self.groups.values():
            for sid, toks in zip(g.seq_ids, g.tokens):
                tokens[sid] = toks
        n = len(self.msg.input_ids)
        self.agent._post(RunFinished(run_id=self.msg.run_id, tokens=tuple(tuple(tokens.get(i, ())) for i in range(n))))
