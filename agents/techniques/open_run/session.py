"""An open run on one stage: the shared stage run (``agents.stage_run.StageRun``) with micro-batches
that join and leave between steps (continuous batching across the pipeline).

It is the same schedule, not a second runtime: every step is ``agents.schedule.step_operations``;
the source starts a joined micro-batch's prefill as ``agents.schedule.join`` says for the run's mode
and its later steps by ``on_returned``, as a closed run does. What differs:

- the run starts empty and ends only when stopped;
- a ``JoinRun`` (handed over by the control thread, which wakes the data receive) sets a micro-batch
  up: at the source its prompts and per-sequence token budgets, at the last stage its rows' sampling.
  **Sampling is per row** (``_Row``): each row samples with its join's temperature, top-p, penalties
  and its own history (its prompt without pads, then its tokens), and draws from a generator keyed by
  its join's seed and key, its place in the join, and its own token count since it joined, so a
  request's tokens do not depend on who else runs or when it joined;
- a micro-batch whose every sequence is done (EOS, its budget, or left by a ``LeaveRun``) is retired
  once its step in flight is back: the source drops its KV cache and sends a ``retire`` frame down
  the ring, and every stage drops its own at once. Its index may then be joined again; a join of an
  index still in flight waits for that retire (links are FIFO, so every stage sees the old group's
  last step, then its retire, then the new prefill).
- rows join and leave a *running* micro-batch (one batched forward per stage and step, as
  transformers' batched ``generate``): a ``JoinRun`` with ``grow`` is prefilled within the
  micro-batch's next step (its running rows feed their last token after masked pads, the new rows
  their left-padded prompts after masked columns for the running rows' past: ``StageExecutor.extend``);
  rows that are done are dropped before the next step by a ``shrink`` frame down the ring
  (``StageExecutor.keep_rows``, which also drops the columns no kept row attends; the last stage
  drops their ``_Row`` too). Any rows may join any micro-batch: greedy, sampled or penalised.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

from agents.envelope import MAX_NEW_TOKENS
from agents.protocol import DataHeader
from agents.sampling import greedy_tokens, step_generator
from agents.schedule import SourceState, join
from agents.stage_run import StageRun, _Group
from agents.techniques.open_run.messages import RETIRE, SHRINK, JoinRun, LeaveRun
from agents.transport import RunAborted, data_message, tensor_frame, tensor_from_frame

ROOM = "open_run"
"""This technique's state on an agent (``Agent.room``): ``handed`` maps a run id to the joins and
leaves handed over by the control thread, not yet taken by the run."""


JOIN_WAIT_S = 5.0
"""How long the last stage waits for a join whose prefill overtook it (the coordinator sent it first)."""


ROW_MIX = 0xD6E8FEB86659FD93
"""Mixes a row's place in its join into its seed: the rows of one sampled join draw independently."""


def handed(agent, run_id: str) -> collections.deque:
    return agent.room(ROOM).setdefault("handed", {}).setdefault(run_id, collections.deque())


@dataclass
class _Row:
    """Last stage: how one row of a micro-batch samples (its join's sampling, its own draws and history)."""

    sample: object
    """The join's sampler (``agent.sampler_factory``): ``(logits [1, V], generator, history [1, L],
    prompt_length) -> [1]``."""
    join: JoinRun
    place: int
    """The row's index within its join (row 0 draws exactly as the join's micro-batch alone did)."""
    joined_step: int
    """The micro-batch step that prefilled it: its ``k``-th token is drawn at step ``joined_step + k``."""
    history: torch.Tensor | None
    """Its tokens so far (its prompt without pads, then every token sampled), when its sampler reads them."""
    prompt_length: int = 0
    """Where its generated tokens start in ``history`` (a resumed row's prompt ends with its tokens so far)."""

    plain: bool = field(init=False)
    """Greedy with no history nor bias: its token is the argmax, taken with every such row at once (set once,
    from its join: read for every row of every step)."""

    def __post_init__(self) -> None:
        s = self.join.sampling
        self.plain = s.temperature <= 0 and self.history is None and not s.logit_bias

    def generator(self, step: int) -> torch.Generator | None:
        """The draw of micro-batch step ``step``, keyed by the row's own position only (None: greedy)."""
        s, j = self.join.sampling, self.join
        if s.temperature <= 0:
            return None
        seed = s.seed if self.place == 0 else (s.seed + self.place * ROW_MIX) % (1 << 63)
        return step_generator(seed, j.key, j.first_step + step - self.joined_step)


class OpenStageRun(StageRun):
    """One stage's part of an open run (``drive``)."""

    def __init__(self, agent, loaded, msg, stop) -> None:
        super().__init__(agent, loaded, msg, stop)
        self.handed = handed(agent, msg.run_id)
        self.budgets: dict[int, tuple[int, ...]] = {}
        """Source: per micro-batch, each sequence's most tokens."""
        self.deferred: list[JoinRun] = []
        """Source: joins of an index whose previous micro-batch is not retired yet."""
        self.left: set[int] = set()
        self.grows: dict[int, collections.deque[JoinRun]] = collections.defaultdict(collections.deque)
        """Source: joins of rows into a running micro-batch, taken one per step boundary."""
        self.grown: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Source: the next step's input and new columns' mask of a micro-batch that rows just joined."""
        self.row_samplers: dict[int, list[_Row]] = {}
        """Last stage: each running micro-batch's rows' sampling, in row order."""
        self.next_samplers: dict[int, collections.deque[JoinRun]] = collections.defaultdict(collections.deque)
        """Last stage: joins whose prefill has not arrived yet, per index, in join order."""
        self.unprefilled: dict[int, int] = collections.defaultdict(int)
        """Last stage: per index, joins retired before their prefill that have not been handed over yet."""
        self.rows: dict[int, int] = {}
        """Last stage: each running micro-batch's rows (a grown step's new rows are its joins' sequences)."""
        self.first_token_steps: dict[int, int] = {}
        """Source: per micro-batch, the step in flight that brings joined rows their first token (a grown step)."""

    def _execute(self) -> None:
        if self.is_first:
            self.source = SourceState(self.msg.mode, MAX_NEW_TOKENS, (), (), ())
        while not self.stop.is_set():
            self._take_handed()
            if self.is_first:
                self._run_injections()
            received = self.agent.receive_data(1 << 30, timeout_ms=None)  # a join or a stop wakes it
            if received is not None:
                header = received[0]
                if header.kind == RETIRE and header.run_id == self.msg.run_id:
                    self._retire(header.micro_batch)
                elif header.kind == SHRINK and header.run_id == self.msg.run_id:
                    self._keep(header.micro_batch, tensor_from_frame(header.tensors[0], received[1][0]))
                else:
                    self._on_data(*received)
            self.wait_started = self.clock()
        raise RunAborted()

    # ------------------------------------------------------------------ joins and leaves
    def _take_handed(self) -> None:
        while self.handed:
            msg = self.handed.popleft()
            if isinstance(msg, LeaveRun):
                self._leave(set(msg.sequence_ids))
            else:
                if self.is_last and self.unprefilled[msg.micro_batch]:
                    self.unprefilled[msg.micro_batch] -= 1  # retired before its prefill (``_retire``)
                elif self.is_last:
                    self.next_samplers[msg.micro_batch].append(msg)
                if self.is_first:
                    self._join(msg)

    def _join(self, msg: JoinRun) -> None:
        mb = msg.micro_batch
        if msg.grow and mb in self.groups and not any(m.micro_batch == mb for m in self.deferred):
            self.grows[mb].append(msg)  # taken when its running step is back
            return
        if mb in self.groups:  # its old group is in flight: after the retire
            self.deferred.append(msg)
            return
        n = len(msg.sequence_ids)
        self.groups[mb] = _Group(index=mb, seq_ids=msg.sequence_ids,
                                 input_ids=torch.tensor(msg.input_ids, dtype=torch.int64),
                                 attention_mask=torch.tensor(msg.attention_mask, dtype=torch.int64),
                                 tokens=[[] for _ in range(n)], finished=[s in self.left for s in msg.sequence_ids])
        self.budgets[mb] = msg.max_new_tokens
        self.source, started = join(self.source, mb)
        self.injections.extend(started)
        if all(self.groups[mb].finished):  # every client left before its prefill
            self._leave(set())

    def _leave(self, sequence_ids: set[int]) -> None:
        self.left |= sequence_ids
        if not self.is_first:
            return
        for g in list(self.groups.values()):
            g.finished = [f or s in self.left for f, s in zip(g.finished, g.seq_ids)]
            g.done = all(g.finished)
            mb = g.index
            if self._ends(g) and self.source.started[mb] < 0:  # not started (sequential, bubbles): no step to wait
                finished = list(self.source.finished)
                finished[mb] = True
                self.source = SourceState(self.source.mode, self.source.steps, self.source.started,
                                          self.source.returned, tuple(finished))
                self.injections = collections.deque(s for s in self.injections if s.micro_batch != mb)
                self._retire(mb)  # its join, queued at the last stage, never meets a prefill: dropped there

    # ------------------------------------------------------------------ the source's steps
    def _sequence_done(self, g, i: int, token: int, eos: set[int]) -> bool:
        """A sequence ends at an EOS token, at its own budget, or when its client left."""
        return token in eos or len(g.tokens[i]) >= self.budgets[g.index][i] or g.seq_ids[i] in self.left

    def _ends(self, g) -> bool:
        return g.done and not self.grows[g.index]

    def _on_tokens(self, mb: int, step: int, ids: torch.Tensor, t: float) -> None:
        super()._on_tokens(mb, step, ids, t)  # the tokens go out, the next steps start (none once done)
        first = step == 0 or self.first_token_steps.get(mb) == step
        if first:
            self.first_token_steps.pop(mb, None)
        g = self.groups[mb]
        ended = any(g.finished)
        if first or ended:
            # A request's first token, and the last of one that ended here, go to the coordinator now, not after
            # the next step's compute (the closed run's order: a served request's TTFT paid that whole step,
            # ~1.7-2.3 ms on the demo model, and so did the end of one whose rows go on: its client's [DONE],
            # and a closed-loop client's next request)
            self.agent._wake_for_outbox()
        if self._ends(g):
            self._retire(mb)
            return
        if ended:
            self._shrink(g)
        if self.grows[mb]:  # every join that came while the step ran: one grown step, not one step each
            joins = list(self.grows[mb])
            self.grows[mb].clear()
            self._grow(g, joins)

    def _shrink(self, g) -> None:
        """Drop ``g``'s done rows on every stage before its next step (a ``shrink`` frame down the ring)."""
        keep = [i for i, f in enumerate(g.finished) if not f]
        rows = torch.tensor(keep, dtype=torch.int64)
        g.seq_ids = tuple(g.seq_ids[i] for i in keep)
        g.tokens = [g.tokens[i] for i in keep]
        g.finished = [False] * len(keep)
        g.last = g.last[rows]
        self.budgets[g.index] = tuple(self.budgets[g.index][i] for i in keep)
        self._keep(g.index, rows)

    def _grow(self, g, joins: list[JoinRun]) -> None:
        """``joins``' rows join ``g`` (every join waiting for this step boundary, one prefill for all): its next
        step feeds the running rows' last token after masked pads and the new rows' prompts (left-padded to
        the longest) after masked columns for the running rows' past."""
        width = max(len(m.input_ids[0]) for m in joins)
        pad = self.msg.pad_token_id
        ids = torch.tensor([(pad,) * (width - len(r)) + tuple(r) for m in joins for r in m.input_ids], dtype=torch.int64)
        new_mask = torch.tensor([(0,) * (width - len(r)) + tuple(r) for m in joins for r in m.attention_mask],
                                dtype=torch.int64)
        old = g.last.view(-1, 1)
        x = torch.cat([torch.cat([old.new_full((old.shape[0], width - 1), pad), old], dim=1), ids])
        cols = torch.zeros((old.shape[0], width), dtype=torch.int64)
        cols[:, -1] = 1
        self.grown[g.index] = x, torch.cat([cols, new_mask])
        for msg in joins:
            g.seq_ids = g.seq_ids + msg.sequence_ids
            g.tokens = g.tokens + [[] for _ in msg.sequence_ids]
            g.finished = g.finished + [s in self.left for s in msg.sequence_ids]
            self.budgets[g.index] = self.budgets[g.index] + msg.max_new_tokens
        g.done = all(g.finished)

    def _step_input(self, g, step):
        grown = self.grown.pop(g.index, None) if step.step > 0 else None
        if grown is not None:
            self.first_token_steps[g.index] = step.step
        return grown if grown is not None else super()._step_input(g, step)

    def _keep(self, mb: int, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of micro-batch ``mb`` here and pass the ``shrink`` on down the ring."""
        self.ex.keep_rows(mb, rows)
        self.rows[mb] = len(rows)
        if mb in self.row_samplers:
            self.row_samplers[mb] = [self.row_samplers[mb][i] for i in rows.tolist()]
        if not self.is_last:
            spec, buf = tensor_frame(rows)
            header = DataHeader(run_id=self.msg.run_id, kind=SHRINK, phase="decode", step=0, micro_batch=mb,
                                sender=self.agent.device, tensors=(spec,), t_sent=self.clock())
            self.loaded.sender.send(data_message(header, [buf]), spec.nbytes(), None, self.stop, kind=SHRINK)

    def _frame_problem(self, header: DataHeader) -> str:
        if header.kind == "hidden" and header.step > 0 and len(header.tensors) == 2 and not self.is_first:
            return ""  # a step that rows joined: the new columns' mask beside the hidden states
        return super()._frame_problem(header)

    def _forward(self, op, x, mask):
        if op.step > 0 and mask is not None:  # rows joined this running micro-batch
            return self.ex.extend(op.micro_batch, x, mask)
        return super()._forward(op, x, mask)

    def _retire(self, mb: int) -> None:
        """Drop micro-batch ``mb``'s KV cache here and pass the retire on down the ring. At the last stage, a
        retire of a micro-batch it never sampled is of a join whose rows all left before its prefill (the
        source dropped it unstarted): that join is dropped, else the next prefill of ``mb`` sampled by it."""
        if self.is_last and mb not in self.row_samplers:
            if not self.next_samplers[mb]:
                self._take_handed()
            if self.next_samplers[mb]:
                self.next_samplers[mb].popleft()
            else:  # its join has not been handed over yet: dropped when it is
                self.unprefilled[mb] += 1
        self.ex.drop(mb)
        self.seen_groups.discard(mb)
        self.rows.pop(mb, None)
        self.row_samplers.pop(mb, None)
        self.grows.pop(mb, None)
        self.grown.pop(mb, None)
        self.first_token_steps.pop(mb, None)
        if self.is_first:
            g = self.groups.pop(mb, None)
            if g is not None:
                self.left -= set(g.seq_ids)
        if not self.is_last:
            header = DataHeader(run_id=self.msg.run_id, kind=RETIRE, phase="decode", step=0, micro_batch=mb,
                                sender=self.agent.device, tensors=(), t_sent=self.clock())
            self.loaded.sender.send(data_message(header, []), 0, None, self.stop, kind=RETIRE)
        if self.is_first:
            self._rejoin(mb)

    def _rejoin(self, mb: int) -> None:
        """Joins that waited for ``mb``'s retire (or any other index's) that can go now."""
        ready = True
        while ready:
            ready = next((m for m in self.deferred if m.micro_batch not in self.groups), None)
            if ready is not None:
                self.deferred.remove(ready)
                self._join(ready)
                for grow in [m for m in self.deferred if m.micro_batch == ready.micro_batch and m.grow]:
                    if ready.micro_batch not in self.groups:
                        break
                    self.deferred.remove(grow)  # rows that joined it before it started
                    self._join(grow)

    # ------------------------------------------------------------------ the last stage's sampling
    def _compute(self, op, x, mask):
        if op.samples:
            mb, step = op.micro_batch, op.step
            if step == 0 or mask is not None:  # a prefill, or rows joined: their joins are the next ones
                rows = self.row_samplers[mb] = [] if step == 0 else self.row_samplers[mb]
                new = x.shape[0] - len(rows)
                while new > 0:  # a grown step takes every join the source merged into it
                    joined = self._join_of(mb).popleft()
                    rows.extend(self._rows_of(joined, step))
                    new -= len(joined.sequence_ids)
                self.rows[mb] = x.shape[0]
            self.sample = lambda logits, generator, history, prompt_length: self._sample_rows(mb, step, logits)
        return super()._compute(op, x, mask)

    def _rows_of(self, joined: JoinRun, step: int) -> list[_Row]:
        sample = self.agent.sampler_factory(joined.sampling)
        histories = [None] * len(joined.sequence_ids)
        if joined.sampling.uses_history:  # each row's own prompt: a neighbour's padding is not its history
            histories = [torch.tensor([t for t, m in zip(ids, mask) if m], dtype=torch.int64)
                         for ids, mask in zip(joined.input_ids, joined.attention_mask)]
        return [_Row(sample, joined, place, step, history, 0 if history is None else len(history) - joined.first_step)
                for place, history in enumerate(histories)]

    def _sample_rows(self, mb: int, step: int, logits: torch.Tensor) -> torch.Tensor:
        """Each row's token by its own sampling: plain greedy rows by one argmax, the others one by one."""
        rows = self.row_samplers[mb]
        tokens = greedy_tokens(logits)
        for i, row in enumerate(rows):
            if row.plain:
                continue
            history = row.history.view(1, -1) if row.history is not None else None
            tokens[i] = row.sample(logits[i:i + 1], row.generator(step), history, row.prompt_length).view(-1)[0]
            if row.history is not None:
                row.history = torch.cat([row.history, tokens[i:i + 1]])
        return tokens

    def _join_of(self, mb: int) -> collections.deque[JoinRun]:
        """The joins of ``mb`` handed over so far, the one this step starts first: the coordinator does not
        wait for the last stage's reply before the source's, so a prefill may overtake its join (waited for)."""
        deadline = time.monotonic() + JOIN_WAIT_S
        self._take_handed()
        while not self.next_samplers[mb] and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.0002)
            self._take_handed()
        if not self.next_samplers[mb]:
            raise ValueError(f"micro-batch {mb}'s prefill arrived and its join did not within {JOIN_WAIT_S} s")
        return self.next_samplers[mb]

    def _generator(self, mb: int, step: int) -> None:
        return None  # each row draws from its own (``_Row.generator``)


def drive(agent, loaded, msg, stop):
    """The run driver of ``StartRun`` with ``OpenRunOptions``: serve the open run until stopped."""
    run = OpenStageRun(agent, loaded, msg, stop)
    try:
        run.execute()
    finally:
        run.drop_all()
        agent.room(ROOM).get("handed", {}).pop(msg.run_id, None)
    return ()
