"""Fixed and rotational staggered pipelining, simulated into the shared TimelineEvents.

The order is not decided here: ``agents.schedule.staggered_slices`` (the one schedule, which the
agents execute too) says which replica runs each slice of each batch and in what order. Here
it is timed: each replica performs its slices in that order, each as early as its batch's
previous slice (its attention outputs and residual) and the replica allow; each memory device
serves the attentions of its heads as their frames arrive, first come first served (the
attention lanes). On a host whose cores the agents share (a local cluster: ``host_cores``,
``background``) the slices, residual frames and attentions computing at once share the cores
(``core.runs.shared_host.SharedCores``, as layer sharding's simulator does). Events are what a real run records (agents.techniques.attention_offload.staggered): a
``compute`` per slice on its replica (stage = the layer whose attention follows, ``layers`` for
the tail), a ``send`` from the replica to each memory device (q, k, v and a frame header), the
attention ``compute`` and its answer ``send`` (the output) on each memory device, and a ``send``
of the residual when the next slice runs on another replica.
Step 0 is the prefill: dense time of B·prompt tokens, attention by its FLOPs on the memory devices.
"""

from __future__ import annotations

import heapq
from collections import deque

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from agents.techniques.attention_offload.schedule import STAGGERED_SCHEDULES, staggered_slices
from core.runs.metrics import RunFigures, compute_figures
from core.runs.shared_host import SharedCores
from core.techniques.attention_offload.cost import (
    FRAME_HEADER_BYTES, attention_seconds_by_device, dense_seconds, head_seconds, link_seconds, residual_seconds,
)
from core.techniques.attention_offload.problem import OffloadPlan, OffloadProblem, check_plan


class OffloadSimulation(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures
    decode_tokens_per_s: float
    """Steady decode throughput: per batch, decode tokens over their span (prefill apart), summed."""
    work_s: dict[str, float] = {}
    """Per device: the seconds of work its jobs needed at a full core (slices, residual frames,
    attentions), decode steps only: what its CPU time is predicted to be (``host_cores`` stretches
    spans, not work)."""
    busy_s: dict[str, float] = {}
    """Per device: the seconds its decode jobs took (their spans); work / busy is the share of a core
    it got while it had work, what the scheduler reports as CPU / (CPU + run-queue wait)."""

    def core_share(self, device: str) -> float:
        busy = self.busy_s.get(device, 0.0)
        return self.work_s.get(device, 0.0) / busy if busy > 0 else 1.0


def _prefill_attention_s(problem: OffloadProblem, plan: OffloadPlan) -> list[float]:
    """Per memory device: its heads' prefill attention by FLOPs (QK^T and PV, causal half), and the
    frame it receives and the one it answers (``frame_s`` each, as in decode)."""
    m, p = problem.model, problem.workload.prompt_tokens
    group = m.q_heads // m.kv_heads
    return [4 * plan.batch * p * p * len(h) * group * m.head_dim / 2 / problem.device(d).flops
            + 2 * problem.device(d).frame_s for d, h in plan.kv_heads_of(m.kv_heads).items()]


def simulate(problem: OffloadProblem, plan: OffloadPlan, mode: str | None = None, *,
             generated_tokens: int | None = None, host_cores: int | None = None, background: float = 0.0,
             micro_batch_sizes: tuple[int, ...] | None = None, prompt_tokens: int | None = None,
             **_) -> OffloadSimulation:
    """``mode``: ``fixed`` or ``rotational`` (default: the plan's schedule). ``host_cores``: the
    devices are agents on one host with that many cores, shared with ``background`` other runnable
    processes (``core.runs.shared_host``: every slice, residual frame and attention computing at
    once progresses at min(1, cores / (jobs + background))); None: independent devices.
    ``micro_batch_sizes``: a run's batches (the Run screen's prompts, ``core.runs.prediction``): as many in
    flight, each of the largest's size, instead of the plan's (planned for a throughput-sized batch).
    ``prompt_tokens``: the run's prompt width (its prefill and the context its attention reads), in place
    of the problem's workload (a profile's prompt length)."""
    if prompt_tokens:
        problem = msgspec.structs.replace(problem, workload=msgspec.structs.replace(problem.workload,
                                                                                   prompt_tokens=prompt_tokens))
    if micro_batch_sizes:
        plan = msgspec.structs.replace(plan, batch=max(micro_batch_sizes), in_flight=len(micro_batch_sizes))
    check_plan(problem, plan)
    schedule = mode or plan.schedule
    if schedule not in STAGGERED_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: fixed or rotational")
    if host_cores is not None and host_cores < 1:
        raise ValueError("host_cores must be at least 1")
    steps = generated_tokens or problem.workload.generated_tokens
    return _Simulation(problem, plan, schedule, steps, host_cores, background).run()


_DONE, _INPUT, _AT_MEMORY = range(3)


class _Simulation:
    """Event-driven: a replica runs its slices in the schedule's order, each once its inputs (every
    memory device's answer and the residual) arrived; a memory device serves attentions as their
    frames arrive, first come first served; with ``host_cores`` the jobs share the cores."""

    def __init__(self, problem, plan, schedule, steps, host_cores, background):
        self.problem, self.plan, self.steps = problem, plan, steps
        self.model = model = problem.model
        self.memory = [problem.device(d) for d in plan.memory]
        self.layers = model.layers
        self.heads = plan.kv_heads_of(model.kv_heads)
        self.ctx = problem.workload.prompt_tokens
        order = staggered_slices(schedule, len(plan.compute), plan.in_flight, steps, self.layers)
        self.nxt = {(s.micro_batch, s.index): s.replica for s in order}
        self.queue = {d: deque(s for s in order if plan.compute[s.replica] == d) for d in plan.compute}
        self.busy = {d: False for d in list(plan.compute) + list(plan.memory)}
        self.mem_queue: dict[str, deque] = {d: deque() for d in plan.memory}
        self.need = {(s.micro_batch, s.index): 0 if s.index == 0 else len(plan.memory) + 1 for s in order}
        self.moved_in: dict[tuple[int, int], float] = {}
        self.heap: list = []
        self.seq = 0
        self.jobs: dict[tuple, tuple[float, object]] = {}
        self.shared = SharedCores(host_cores, lambda t, key, v: self.push(t, _DONE, key, v), background) \
            if host_cores is not None else None
        self.events: list[TimelineEvent] = []
        self.tokens: list[TokenEvent] = []
        self.work: dict[str, float] = {d: 0.0 for d in self.busy}
        self.busy_s: dict[str, float] = {d: 0.0 for d in self.busy}
        self.decode_job: dict[tuple, bool] = {}

    def push(self, t, action, *args):
        heapq.heappush(self.heap, (t, self.seq, action, args))
        self.seq += 1

    def _job(self, key, work: float, t: float, payload, step: int) -> None:
        self.decode_job[key] = step >= 1
        if step >= 1:
            self.work[key[1]] += work
        if self.shared is not None:
            self.shared.start(key, work, t, payload)
        else:
            self.jobs[key] = (t, payload)
            self.push(t + work, _DONE, key, None)

    def run(self) -> OffloadSimulation:
        for d in self.plan.compute:
            self._try_replica(d, 0.0)
        while self.heap:
            t, _, action, args = heapq.heappop(self.heap)
            if action == _DONE:
                key, version = args
                got = self.shared.finish(key, version, t) if self.shared is not None else self.jobs.pop(key)
                if got is None:
                    continue
                start, payload = got
                if self.decode_job[key]:
                    self.busy_s[key[1]] += t - start
                if key[0] == "memory":
                    self._attended(key[1], start, t, *payload)
                elif payload is None:  # a residual frame sent: the replica is free
                    self._free(key[1], t)
                else:
                    self._sliced(key[1], start, t, *payload)
            elif action == _INPUT:
                b, k = args
                self.need[b, k] -= 1
                if self.need[b, k] == 0:
                    self._try_replica(self.plan.compute[self.nxt[b, k]], t)
            else:
                m_id, job = args
                self.mem_queue[m_id].append(job)
                self._try_memory(m_id, t)
        events = sorted(self.events, key=lambda e: (e.start_s, e.device))
        tokens = sorted(self.tokens, key=lambda t: t.t_s)
        return OffloadSimulation(events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens),
                                 decode_tokens_per_s=decode_tokens_per_s(tokens), work_s=self.work,
                                 busy_s=self.busy_s)

    def _free(self, device: str, t: float) -> None:
        self.busy[device] = False
        self._try_replica(device, t)

    def _try_replica(self, device: str, t: float) -> None:
        q = self.queue[device]
        if self.busy[device] or not q or self.need[q[0].micro_batch, q[0].index] > 0:
            return
        s = q.popleft()
        problem, dev = self.problem, self.problem.device(device)
        rows = self.plan.batch * (self.ctx if s.step == 0 and s.index < self.layers else 1)
        samples = s.index >= self.layers and s.index % self.layers == 0  # the head of the step before, then sampling
        head = head_seconds(problem, dev, self.plan.batch) if samples else 0.0
        moved = self.moved_in.pop((s.micro_batch, s.index), 0.0)
        dense = 0.0 if s.is_tail else dense_seconds(problem, dev, rows, len(self.memory))
        self.busy[device] = True
        self._job(("compute", device), moved + head + dense, t, (s, rows, (moved + head) if samples else None,
                                                                 moved + head + dense), s.step)

    def _sliced(self, device: str, start: float, t: float, s, rows: int, to_token, work: float) -> None:
        problem, model, plan = self.problem, self.model, self.plan
        b, step, layer = s.micro_batch, s.step, s.layer
        dev = problem.device(device)
        common = dict(step=step, micro_batch=b, phase=s.phase)
        self.events.append(TimelineEvent(device=device, stage=layer, kind="compute", start_s=start, end_s=t, **common))
        if to_token is not None:  # the head ran first in the slice (its share of the slice's span)
            done = step - 1 if not s.is_tail else step
            self.tokens.append(TokenEvent(micro_batch=b, step=done,
                                          sequence_ids=tuple(range(b * plan.batch, (b + 1) * plan.batch)),
                                          token_ids=(0,) * plan.batch,
                                          t_s=start + (t - start) * (to_token / work if work > 0 else 1.0)))
        if s.is_tail:
            self._free(device, t)
            return
        following = plan.compute[self.nxt[b, s.index + 1]]
        link = link_seconds(problem, dev, self.memory, rows)
        bpe, group = model.bytes_per_element, model.q_heads // model.kv_heads
        if step == 0:
            attention = _prefill_attention_s(problem, plan)
        else:
            attention = attention_seconds_by_device(problem, self.memory, plan.batch, self.ctx + step - 1)
        for m_id, work in zip(plan.memory, attention):
            h = len(self.heads[m_id])
            self.events.append(TimelineEvent(device=device, stage=layer, kind="send", start_s=t, end_s=t + link / 2,
                                             nbytes=rows * (h * group + 2 * h) * model.head_dim * bpe
                                             + FRAME_HEADER_BYTES, peer=m_id, **common))
            self.push(t + link / 2, _AT_MEMORY, m_id, (s, rows, following, link, work))
        if following == device:
            self.push(t, _INPUT, b, s.index + 1)
            self._free(device, t)
            return
        moved = residual_seconds(problem, dev, problem.device(following), rows)
        self.events.append(TimelineEvent(device=device, stage=layer, kind="send", start_s=t, end_s=t + moved,
                                         nbytes=rows * model.hidden * bpe + FRAME_HEADER_BYTES, peer=following,
                                         **common))
        self.push(t + moved, _INPUT, b, s.index + 1)
        self.moved_in[b, s.index + 1] = problem.device(following).frame_s  # received there
        self._job(("compute", device), dev.frame_s, t, None, step)  # sent here

    def _try_memory(self, m_id: str, t: float) -> None:
        if self.busy[m_id] or not self.mem_queue[m_id]:
            return
        s, rows, following, link, work = self.mem_queue[m_id].popleft()
        self.busy[m_id] = True
        self._job(("memory", m_id), work, t, (s, rows, following, link), s.step)

    def _attended(self, m_id: str, start: float, t: float, s, rows: int, following: str, link: float) -> None:
        model = self.model
        common = dict(step=s.step, micro_batch=s.micro_batch, phase=s.phase)
        h = len(self.heads[m_id])
        self.events.append(TimelineEvent(device=m_id, stage=s.layer, kind="compute", start_s=start, end_s=t, **common))
        self.events.append(TimelineEvent(device=m_id, stage=s.layer, kind="send", start_s=t, end_s=t + link / 2,
                                         nbytes=rows * h * (model.q_heads // model.kv_heads) * model.head_dim
                                         * model.bytes_per_element + FRAME_HEADER_BYTES, peer=following, **common))
        self.push(t + link / 2, _INPUT, s.micro_batch, s.index + 1)
        self.busy[m_id] = False
        self._try_memory(m_id, t)


def decode_tokens_per_s(tokens) -> float:
    """Steady decode rate of a run (simulated or measured, ``TokenEvent``s): each batch's tokens from
    its first decode step to its last (the prefill apart), summed over the batches."""
    total = 0.0
    for b in sorted({t.micro_batch for t in tokens}):
        mine = sorted((t.t_s, len(t.sequence_ids)) for t in tokens if t.micro_batch == b and t.step >= 1)
        if len(mine) > 1 and mine[-1][0] > mine[0][0]:
            total += sum(n for _, n in mine[1:]) / (mine[-1][0] - mine[0][0])
    return total
