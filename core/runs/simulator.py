"""Discrete-event simulator of a shard plan: the predicted timeline before a run.

Why a simulator beside the closed forms of ``core.planning.cost``: the closed forms give one
decode step's latency and the steady-state throughput of a pipeline without bubbles;
they do not show the bubbles of a synchronous pipeline, a micro-batch's transfer queued
behind another's on the same link, or how prefill and decode interleave. The simulator
plays the plan out event by event with the same per-unit times and transfer terms
(``core.planning.cost.stage_compute_s`` / ``stage_output_bytes`` / ``Link``), so where the closed
forms apply the two agree exactly (see tests/core/test_simulator.py).

Resources and rules:
- each stage computes one micro-batch at a time, first come first served;
- each link direction carries one transfer at a time: it is occupied for
  size / bandwidth, and the latency delays the arrival without occupying the link;
- a stage hands its output to its link and starts its next micro-batch at once
  (compute/communication overlap); ``overlap=False`` makes it wait for the send;
- the last stage sends the sampled token ids back to the source; a token's arrival
  there is a ``TokenEvent`` and may release the micro-batch's next step.

Schedules (EdgeShard §IV-C): the run's schedule is ``agents.schedule``, the one the agents
execute: when the source starts each micro-batch's step (``begin`` / ``on_returned``; in
``sequential`` one micro-batch at a time, start to finish) and what each stage does for it
(``step_operations``: receive, compute, send). The simulator times those operations.

Step 0 is the prefill (one pass over the prompt, producing the first token), steps
1..G-1 the decode steps, G = the workload's generated tokens. The emitted events are
the ``TimelineEvent`` type a real run emits, ordered by end time (when a real agent
would report them), so the GUI draws predicted and measured timelines alike.
"""

from __future__ import annotations

import heapq
from collections import deque
import msgspec

from agents.protocol import RUN_MODES, RunMode, TimelineEvent, TokenEvent
from agents.schedule import Compute, Send, Step, begin, on_returned, phase_of, step_operations
from core.planning.cost import (
    link_occupancy_s,
    next_device,
    stage_compute_s,
    stage_output_bytes,
    structural_violations,
)
from core.errors import PlanInvalid
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.runs.metrics import RunFigures, compute_figures
from core.runs.shared_host import SharedCores

Mode = RunMode
MODES = RUN_MODES
"""Re-exported from ``agents.protocol``: the simulator models exactly the runtime's modes."""


class SimulationResult(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    micro_batch_size: int
    micro_batches: int
    generated_tokens: int
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures
    """The same figures a real run gets (``core.runs.metrics``)."""
    steady_tokens_per_s: float | None
    """Decode throughput over the middle half of the decode steps (whole rounds)."""
    link_wait_s: float
    """Total time transfers waited for a link busy with another transfer (contention)."""
    step_done_s: tuple[float, ...]
    """Per step: when the last micro-batch's token of that step reached the source."""


def simulate(
    problem: PlanningProblem,
    plan: ShardPlan,
    mode: str = "sequential",
    *,
    micro_batches: int | None = None,
    micro_batch_size: int | None = None,
    generated_tokens: int | None = None,
    overlap: bool = True,
    host_cores: int | None = None,
    micro_batch_sizes: tuple[int, ...] | None = None,
) -> SimulationResult:
    """Play ``plan`` out on ``problem`` and return the predicted events and figures.

    Defaults: ``sequential`` serves the workload's batch as one micro-batch; the pipeline
    modes use the plan's micro-batch size and count. Raises ``PlanInvalid`` for a plan
    whose shape is broken (memory is the cost model's concern, not the simulator's).

    ``host_cores``: the stages' devices are emulated on one host with that many cores
    (a local cluster): n stages computing at once each progress at min(1, cores / n)
    (processor sharing). None: independent devices, as in the cost model.

    ``micro_batch_sizes``: the size of each micro-batch when they differ (a real run splits
    5 prompts into 3 + 2, ``core.runs.coordinator.split_micro_batches``); it overrides
    ``micro_batches`` and ``micro_batch_size``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    violations = structural_violations(problem, plan)
    if violations:
        raise PlanInvalid(violations)
    wl = problem.workload
    if mode == "sequential" and micro_batches is None and micro_batch_size is None:
        k_mb, m = 1, wl.batch_size
    else:
        k_mb = micro_batches if micro_batches is not None else plan.micro_batches
        m = micro_batch_size if micro_batch_size is not None else plan.micro_batch_size
    if micro_batch_sizes is not None:
        if not micro_batch_sizes or min(micro_batch_sizes) < 1:
            raise ValueError("every micro-batch needs at least one sequence")
        k_mb, m = len(micro_batch_sizes), max(micro_batch_sizes)
    g = generated_tokens if generated_tokens is not None else wl.generated_tokens
    if k_mb < 1 or m < 1 or g < 1:
        raise ValueError("micro-batches, micro-batch size and generated tokens must be at least 1")
    if host_cores is not None and host_cores < 1:
        raise ValueError("host_cores must be at least 1")
    return _Simulation(problem, plan, mode, k_mb, m, g, overlap, host_cores, micro_batch_sizes).run()


_ARRIVE, _COMPUTE_DONE, _LINK_DONE, _TOKEN = range(4)


class _Simulation:
    def __init__(self, problem, plan, mode, k_mb, m, g, overlap, host_cores=None, sizes=None):
        self.problem, self.plan, self.mode = problem, plan, mode
        self.k_mb, self.m, self.g, self.overlap = k_mb, m, g, overlap
        self.sizes = tuple(sizes) if sizes is not None else (m,) * k_mb
        self.first_seq = [sum(self.sizes[:mb]) for mb in range(k_mb)]
        self.host_cores = host_cores
        # Processor sharing (host_cores): the stages computing at once share the host's cores.
        self.shared = SharedCores(host_cores, lambda t, j, v: self.push(t, _COMPUTE_DONE, j, None, v)) \
            if host_cores is not None else None
        stages = plan.stages
        self.n = len(stages)
        prompt = problem.workload.prompt_tokens
        links = problem.profile.cluster.link_index()
        # Per stage, phase and micro-batch size: compute seconds, link occupancy and latency, bytes sent.
        self.compute: dict[tuple[int, str, int], float] = {}
        self.xfer: dict[tuple[int, str, int], tuple[float, float, int]] = {}
        for j, st in enumerate(stages):
            times = problem.profile.times_of(st.device)
            last = j == self.n - 1
            for size in set(self.sizes):
                for phase, tokens in (("prefill", size * prompt), ("decode", size)):
                    self.compute[j, phase, size] = stage_compute_s(times, st, phase, tokens)
                    sent = size if (phase == "decode" or last) else size * prompt
                    nbytes = stage_output_bytes(problem, st, sent)
                    nxt = next_device(plan, j)
                    if nxt == st.device:
                        self.xfer[j, phase, size] = (0.0, 0.0, 0)
                    else:
                        occ = link_occupancy_s(problem, st.device, nxt, nbytes)
                        self.xfer[j, phase, size] = (occ, links[(st.device, nxt)].latency_ms / 1e3, nbytes)
        self.heap: list = []
        self.order = 0
        self.stage_queue = [deque() for _ in stages]
        self.stage_busy = [False] * self.n
        self.stage_free_since = [0.0] * self.n
        self.link_queue = [deque() for _ in stages]
        self.link_busy = [False] * self.n
        self.events: list[TimelineEvent] = []
        self.tokens: list[TokenEvent] = []
        self.link_wait = 0.0
        self.step_arrivals: dict[int, list[float]] = {}
        self.units = [(st.start, st.end) for st in stages]
        self.source = None

    def push(self, t, action, *args):
        heapq.heappush(self.heap, (t, self.order, action, args))
        self.order += 1

    def ops(self, j: int, job: tuple[int, int]):
        """Stage ``j``'s operations for ``job`` (micro-batch, step): the agents' own."""
        ops = step_operations(j, self.n, self.units[j], Step(*job))
        compute = next(op for op in ops if isinstance(op, Compute))
        send = next((op for op in ops if isinstance(op, Send)), None)
        return compute, send

    def run(self) -> SimulationResult:
        self.source, started = begin(self.mode, self.k_mb, self.g)
        for s in started:
            self.push(0.0, _ARRIVE, 0, (s.micro_batch, s.step))
        while self.heap:
            t, _, action, args = heapq.heappop(self.heap)
            if action == _ARRIVE:
                j, job = args
                self.stage_queue[j].append(job)
                self._try_stage(j, t)
            elif action == _COMPUTE_DONE:
                job = args[1] if self.shared is None else self._ps_done(t, args[0], args[2])
                if job is not None:
                    self._compute_done(t, args[0], job)
            elif action == _LINK_DONE:
                j = args[0]
                self.link_busy[j] = False
                if not self.overlap:
                    self._free_stage(j, t)
                self._try_link(j, t)
            else:
                self._token(t, args[0])
        return self._result()

    def _try_stage(self, j: int, t: float) -> None:
        if self.stage_busy[j] or not self.stage_queue[j]:
            return
        mb, step = self.stage_queue[j].popleft()
        compute, _ = self.ops(j, (mb, step))
        phase = compute.phase
        dev = self.plan.stages[j].device
        if t > self.stage_free_since[j]:
            self.events.append(TimelineEvent(
                device=dev, stage=j, kind="recv_wait", phase=phase, step=step, micro_batch=mb,
                start_s=self.stage_free_since[j], end_s=t))
        self.stage_busy[j] = True
        d = self.compute[j, phase, self.sizes[mb]]
        if self.shared is not None:
            self.shared.start(j, d, t, (mb, step))
            return
        self.events.append(TimelineEvent(
            device=dev, stage=j, kind="compute", phase=phase, step=step, micro_batch=mb,
            start_s=t, end_s=t + d))
        self.push(t + d, _COMPUTE_DONE, j, (mb, step))

    def _ps_done(self, t: float, j: int, version: int) -> tuple[int, int] | None:
        """Stage ``j``'s job when this completion is current (its compute event recorded), else None."""
        got = self.shared.finish(j, version, t)
        if got is None:
            return None
        start, (mb, step) = got
        self.events.append(TimelineEvent(
            device=self.plan.stages[j].device, stage=j, kind="compute", phase=phase_of(step), step=step,
            micro_batch=mb, start_s=start, end_s=t))
        return mb, step

    def _free_stage(self, j: int, t: float) -> None:
        self.stage_busy[j] = False
        self.stage_free_since[j] = t
        self._try_stage(j, t)

    def _compute_done(self, t: float, j: int, job: tuple[int, int]) -> None:
        _, send = self.ops(j, job)
        if send is None:  # one stage: the sampled tokens are already at the source
            self._token(t, job)
            self._free_stage(j, t)
            return
        self.link_queue[j].append((job, t))
        self._try_link(j, t)
        if self.overlap:
            self._free_stage(j, t)

    def _try_link(self, j: int, t: float) -> None:
        if self.link_busy[j] or not self.link_queue[j]:
            return
        (mb, step), ready = self.link_queue[j].popleft()
        self.link_wait += t - ready
        phase = phase_of(step)
        occ, lat, nbytes = self.xfer[j, phase, self.sizes[mb]]
        self.link_busy[j] = True
        self.events.append(TimelineEvent(
            device=self.plan.stages[j].device, stage=j, kind="send", phase=phase, step=step,
            micro_batch=mb, start_s=t, end_s=t + occ, nbytes=nbytes, peer=next_device(self.plan, j)))
        self.push(t + occ, _LINK_DONE, j)
        _, send = self.ops(j, (mb, step))
        if send.payload == "hidden":
            self.push(t + occ + lat, _ARRIVE, send.to_stage, (mb, step))
        else:
            self.push(t + occ + lat, _TOKEN, (mb, step))

    def _token(self, t: float, job: tuple[int, int]) -> None:
        mb, step = job
        first, size = self.first_seq[mb], self.sizes[mb]
        self.tokens.append(TokenEvent(micro_batch=mb, step=step, sequence_ids=tuple(range(first, first + size)),
                                      token_ids=(0,) * size, t_s=t))
        self.step_arrivals.setdefault(step, []).append(t)
        self.source, started = on_returned(self.source, mb, step)
        for s in started:
            self.push(t, _ARRIVE, 0, (s.micro_batch, s.step))

    def _result(self) -> SimulationResult:
        events = sorted(self.events, key=lambda e: (e.end_s, e.start_s, e.stage, e.kind, e.micro_batch))
        tokens = sorted(self.tokens, key=lambda t: (t.t_s, t.micro_batch))
        step_done = tuple(max(self.step_arrivals[s]) for s in range(self.g))
        # The middle half of the decode steps: past the prefill transient, before the
        # drain (finished micro-batches free shared resources for the last ones).
        lo, hi = max(1, self.g // 4), max(1, (3 * self.g) // 4)
        steady = None
        if hi > lo and step_done[hi] > step_done[lo]:
            steady = sum(self.sizes) * (hi - lo) / (step_done[hi] - step_done[lo])
        return SimulationResult(
            mode=self.mode, micro_batch_size=self.m, micro_batches=self.k_mb, generated_tokens=self.g,
            events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens),
            steady_tokens_per_s=steady, link_wait_s=self.link_wait, step_done_s=step_done,
        )


def simulate_recorded(problem: PlanningProblem, plan: ShardPlan, mode: str, tokens) -> SimulationResult:
    """Predict a run that was recorded: micro-batches, their size and the generated tokens
    are read from its ``TokenEvent``s (what really ran), the rest from the problem."""
    if not tokens:
        raise ValueError("the run has no token outputs to compare with")
    mbs = {t.micro_batch for t in tokens}
    size = max(len(t.sequence_ids) for t in tokens)
    steps = max(t.step for t in tokens) + 1
    return simulate(problem, plan, mode if mode in MODES else "sequential", micro_batches=len(mbs),
                    micro_batch_size=size, generated_tokens=steps)


def simulate_speculative(problem: PlanningProblem, plan: ShardPlan, draft, k: int,
                         generated_tokens: int | None = None) -> SimulationResult:
    """Play one sequence's speculative run out (``core.planning.speculation``'s trip, event by event):
    the prefill through every stage, then trips of ``k`` draft tokens on the draft's device (a ``draft``
    box, ``nbytes`` = proposals; on another stage than the source, with a ``send`` of the tokens it has not
    seen before it and one of the proposals after), a verify of ``k + 1`` positions on every stage and hop (``positions_s``,
    their activations; the last stage returns ``k + 1`` token ids), and the trip's committed tokens.
    Trip i commits ⌊(i+1)·E⌋ − ⌊i·E⌋ tokens (E = E(k) from ``draft.acceptance_rate``: the expected
    rate, in whole tokens); a trip after one that committed fewer than ``k + 1`` starts each stage with
    a ``rollback`` mark of the positions it drops, as a real run draws it. ``draft``: a
    ``core.planning.speculation.DraftFigures``; k = 0 is plain sequential decoding (``simulate``)."""
    from core.planning.cost import _factors, _times, transfer_s
    from core.planning.speculation import expected_tokens_per_trip, positions_s

    if k == 0:
        return simulate(problem, plan, "sequential", micro_batch_sizes=(1,), generated_tokens=generated_tokens)
    violations = structural_violations(problem, plan)
    if violations:
        raise PlanInvalid(violations)
    g = generated_tokens if generated_tokens is not None else problem.workload.generated_tokens
    if k < 0 or g < 1:
        raise ValueError("k must be >= 0 and generated tokens at least 1")
    stages = plan.stages
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []

    def trip(t: float, step: int, phase: str, positions: int, dropped: int) -> float:
        """One pass of ``positions`` tokens through every stage from time ``t``; when the verdict is back."""
        for j, st in enumerate(stages):
            if dropped:
                events.append(TimelineEvent(device=st.device, stage=j, kind="rollback", phase=phase, step=step,
                                            micro_batch=0, start_s=t, end_s=t, nbytes=dropped))
            if phase == "prefill":
                d = stage_compute_s(_times(problem, st.device), st, "prefill", positions)
            else:
                d = positions_s(_times(problem, st.device), st, positions, _factors(problem, st, "prefill"))
            events.append(TimelineEvent(device=st.device, stage=j, kind="compute", phase=phase, step=step,
                                        micro_batch=0, start_s=t, end_s=t + d))
            t += d
            nxt = next_device(plan, j)
            nbytes = stage_output_bytes(problem, st, positions)  # the last stage: a token id per position
            if nxt != st.device:
                hop = transfer_s(problem, st.device, nxt, nbytes)
                events.append(TimelineEvent(device=st.device, stage=j, kind="send", phase=phase, step=step,
                                            micro_batch=0, start_s=t, end_s=t + link_occupancy_s(problem, st.device,
                                                                                                nxt, nbytes),
                                            nbytes=nbytes, peer=nxt))
                t += hop
        return t

    def commit(t: float, count: int) -> None:
        for _ in range(count):
            if len(tokens) < g:
                tokens.append(TokenEvent(micro_batch=0, step=len(tokens), sequence_ids=(0,), token_ids=(0,), t_s=t))

    prompt = problem.workload.prompt_tokens
    commit(trip(0.0, 0, "prefill", prompt, 0), 1)
    expected = expected_tokens_per_trip(draft.acceptance_rate, k)
    t, step, dropped, source = tokens[-1].t_s, 0, 0, stages[0].device
    drafter = getattr(draft, "device", "") or source
    at = next(j for j, st in enumerate(stages) if st.device == drafter) if drafter != source else 0
    fresh = prompt + 1  # the tokens the draft's device has not seen: the first ask carries the whole context

    def hop(t: float, src: str, dst: str, j: int, step: int, nbytes: int) -> float:
        """A draft elsewhere: one ask or answer of token ids between the source and its device."""
        if src == dst:
            return t
        events.append(TimelineEvent(device=src, stage=j, kind="send", phase="decode", step=step, micro_batch=0,
                                    start_s=t, end_s=t + link_occupancy_s(problem, src, dst, nbytes), nbytes=nbytes,
                                    peer=dst))
        return t + transfer_s(problem, src, dst, nbytes)

    while len(tokens) < g:
        step += 1
        proposals = min(k, g - len(tokens) - 1)
        if proposals:
            t = hop(t, source, drafter, 0, step, 8 * fresh)
        events.append(TimelineEvent(device=drafter, stage=at, kind="draft", phase="decode", step=step, micro_batch=0,
                                    start_s=t, end_s=t + proposals * draft.token_s, nbytes=proposals))
        t += proposals * draft.token_s
        if proposals:
            t = hop(t, drafter, source, at, step, 8 * proposals)
        t = trip(t, step, "decode", proposals + 1, dropped)
        committed = min(proposals + 1, int(step * expected) - int((step - 1) * expected) or 1)
        commit(t, committed)
        dropped, fresh = proposals + 1 - committed, committed
    events.sort(key=lambda e: (e.end_s, e.start_s, e.stage, e.kind))
    step_done = tuple(e.t_s for e in tokens)
    return SimulationResult(mode="sequential", micro_batch_size=1, micro_batches=1, generated_tokens=g,
                            events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens),
                            steady_tokens_per_s=None, link_wait_s=0.0, step_done_s=step_done)
