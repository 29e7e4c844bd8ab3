"""Attention offloading measured against its cost model: one run's timeline, decomposed and fitted.

``components`` decomposes any run's decode steps — a real one's events or the simulator's,
which emits the same ones — into the parts of a batch's layer cycle: the dense slice, from
its end to the attention's start (the frames sent, the transit, the memory agent's wake-up),
the attention, from its end to the batch's next slice (the answer, the way back, the wait for
a replica), and the boundary slice of each step (head, sampling, the next step's first
segment). Predicted and measured are then compared term by term.

``calibrate`` fits the cost model's per-device terms to a *profiling run* (one replica,
``run_offload``) so the simulator predicts real runs on that host.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

import msgspec

from agents.protocol import TimelineEvent
from core.techniques.attention_offload.problem import OffloadDevice, OffloadModel, OffloadProblem, OffloadWorkload

WARM_STEPS = 1
"""The first decode step counted. Every decode step is: a run's measured decode rate
(``simulator.decode_tokens_per_s``) counts them all, and on the local cluster the first ~8 steps
are measured 1.5–4× slower than the later ones (17–39 ms against 8–9 ms at batch 3): a
calibration that left 4 out and profiled 16 steps predicted 24-step runs 20–30 % slow."""


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    problem: OffloadProblem
    figures: dict[str, float]
    """What was fitted, in seconds (dense per layer, attention, frame costs, round trip, step)."""


def _slices(events: Sequence[TimelineEvent], compute: Sequence[str], layers: int) -> dict[int, list]:
    """Per micro-batch, its dense slices in order as (step, index in step, start, end, device, whole).
    A one-replica run records L + 1 segments per step (before each attention, and after the
    last); its last segment, the gap to the next step and that step's first segment are the
    step's boundary slice, as a staggered run and the simulator record it."""
    by_step: dict[tuple[int, int], list[TimelineEvent]] = defaultdict(list)
    for e in events:
        if e.kind == "compute" and e.device in compute:
            by_step[e.micro_batch, e.step].append(e)
    out: dict[int, list] = defaultdict(list)
    carry: dict[int, TimelineEvent] = {}
    for (b, step), segs in sorted(by_step.items()):
        segs.sort(key=lambda e: e.start_s)
        if len(segs) == layers + 1:  # one replica: merge the step's last segment into the next's first
            first = segs[0]
            whole = b in carry  # the first step seen has no previous last segment: not a whole boundary
            start = carry[b].start_s if whole else first.start_s
            out[b].append((step, 0, start, first.end_s, first.device, whole))
            out[b] += [(step, j, e.start_s, e.end_s, e.device, True) for j, e in enumerate(segs[1:layers], 1)]
            carry[b] = segs[layers]
        else:
            out[b] += [(step, j, e.start_s, e.end_s, e.device, True) for j, e in enumerate(segs)]
    return out


def components(events: Sequence[TimelineEvent], compute: Sequence[str], memory: Sequence[str], layers: int,
               warm: int = WARM_STEPS, statistic=statistics.median) -> dict[str, float]:
    """``statistic`` (median; ``statistics.fmean`` for the mean) in seconds over the decode steps from
    ``warm`` on of a batch's layer cycle's parts:

    - ``dense_slice``: a middle slice (the dense part of one layer, its frames' CPU where the
      model puts it), ``boundary_slice``: the step's first slice (previous head, sampling,
      turn-around, embedding, layer 0's first half);
    - ``to_attention``: slice end -> attention start (frames out, transit, the memory side waking);
    - ``attention``: the attention span on a memory device;
    - ``to_next_slice``: attention end -> the batch's next slice starts (answer, back, waking,
      and waiting for a busy replica);
    - ``layer_cycle``: slice start -> next slice start; ``step_period``: boundary to boundary;
    - ``send_compute`` / ``send_memory`` / ``send_residual``: send spans (a real run: the frame's
      CPU on the sender; the simulator: bytes over bandwidth and a latency);
    - ``compute_busy`` / ``memory_busy``: share of the decode span each kind of device computes.
    """
    slices = _slices(events, compute, layers)
    attn: dict[tuple[str, int, int], list] = defaultdict(list)
    sends: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.step < warm:
            continue
        if e.kind == "compute" and e.device in memory:
            attn[e.device, e.micro_batch, e.step].append((e.start_s, e.end_s))
        elif e.kind == "send":
            role = "send_memory" if e.device in memory else (
                "send_residual" if e.peer in compute else "send_compute")
            sends[role].append(e.end_s - e.start_s)
    for v in attn.values():
        v.sort()
    parts: dict[str, list[float]] = defaultdict(list)
    for b, chain in slices.items():
        for (step, j, start, end, _, whole), nxt in zip(chain, chain[1:]):
            if step < warm or not whole:
                continue
            parts["boundary_slice" if j == 0 else "dense_slice"].append(end - start)
            spans = [attn[m, b, step][j] for m in memory if len(attn.get((m, b, step), ())) > j]
            if len(spans) != len(memory):
                continue
            a_start = statistics.fmean(s for s, _ in spans)
            a_end = statistics.fmean(e for _, e in spans)
            parts["to_attention"].append(a_start - end)
            parts["attention"].append(a_end - a_start)
            parts["to_next_slice"].append(nxt[2] - a_end)
            parts["layer_cycle"].append(nxt[2] - start)
            if j == 0:
                later = [s for s in chain if s[0] == step + 1 and s[1] == 0]
                if later:
                    parts["step_period"].append(later[0][2] - start)
    out = {k: statistic(v) for k, v in sorted(parts.items()) if v}
    out.update({k: statistic(v) for k, v in sorted(sends.items()) if v})
    span_events = [e for e in events if e.step >= warm and e.kind == "compute"]
    if span_events:
        span = max(e.end_s for e in span_events) - min(e.start_s for e in span_events)
        for kind, devices in (("compute_busy", compute), ("memory_busy", memory)):
            busy = [sum(e.end_s - e.start_s for e in span_events if e.device == d) for d in devices]
            used = [x for x in busy if x > 0]
            if used and span > 0:
                out[kind] = statistics.fmean(used) / span
    return out


def calibrate(model: OffloadModel, runs: Sequence[Sequence[TimelineEvent]], *, compute: Sequence[str],
              memory: Sequence[str], batch: int, prompt_tokens: int, generated_tokens: int,
              warm: int = WARM_STEPS, host_cores: int | None = None, host_share: float = 1.0) -> Calibration:
    """The cost model's problem for the devices of *profiling runs* (one replica on ``compute[0]``,
    ``run_offload``), from the means of their layer cycles' parts (``components``, all runs pooled:
    a stall is as much the host's as the rest):

    - the dense slice -> the compute devices' FLOP rate; the attention span -> the memory devices'
      KV read rate;
    - the rest of the round trip -> per-frame costs (``frame_s``): the memory side's (its receive and
      answer: the answer's send span plus from the dense side's last send to the attention's start)
      and the compute side's (its sends plus from the answer sent to the next slice). On an agent
      that time is CPU and waiting for a core (waking up), not the wire (bytes/bandwidth is
      microseconds here), so it is charged where the model charges CPU; link latency is 0;
    - the boundary slice beyond a dense slice and the head's FLOPs -> ``step_overhead_s``.

    ``host_cores``: the agents share that many cores; the spans then are work stretched by the
    host's load: ``host_share`` is the share of a core the profiled agent got while runnable
    (CPU / (CPU + run-queue wait), from the scheduler), ``figures["background"]`` = cores / share − 1
    other runnable processes, the dense side's work is span × share and the memory side's span ×
    the share m memory agents working at once get (cores / (m + background)); ``simulate(host_cores=,
    background=)`` stretches the work back by the sharing it sees."""
    if not runs:
        raise ValueError("calibrating needs at least one profiling run")
    if not 0.0 < host_share <= 1.0:
        raise ValueError("host_share is a share of a core: in (0, 1]")
    pooled = [e for i, events in enumerate(runs) for e in _renumbered(events, i)]
    c = components(pooled, [compute[0]], memory, model.layers, warm, statistic=statistics.fmean)
    missing = {"dense_slice", "boundary_slice", "attention", "to_attention", "to_next_slice"} - set(c)
    if missing:
        raise ValueError(f"the profiling run has no decode step past warm-up to fit {', '.join(sorted(missing))} from")
    f = host_share if host_cores is not None else 1.0
    m = len(memory)
    background = max(0.0, host_cores / f - 1.0) if host_cores is not None else 0.0
    # the memory agents work at once (every layer's frames reach them together): m jobs share the cores
    f_memory = min(1.0, host_cores / (m + background)) if host_cores is not None else 1.0
    send_c, send_m = c.get("send_compute", 0.0), c.get("send_memory", 0.0)
    frame_c = max(0.0, (m * send_c + c["to_next_slice"] - send_m) / (2 * m)) * f
    frame_m = max(0.0, (send_m + c["to_attention"] - m * send_c) / 2) * f_memory
    dense = c["dense_slice"] * f
    attention = c["attention"] * f_memory
    ctx = prompt_tokens + generated_tokens / 2
    kv_read = batch * ctx * 2 * (model.kv_heads // m) * model.head_dim * model.bytes_per_element
    fast, bandwidth = 1e13, 1e12
    flops = 2 * model.dense_params_per_layer * batch / dense
    head = 2 * model.vocab * model.hidden * batch / flops
    step_overhead = max(0.0, (c["boundary_slice"] - c["dense_slice"]) * f - head)
    devices = [OffloadDevice(id=d, flops=flops, memory_bandwidth=fast, memory_bytes=1 << 40, link_bandwidth=bandwidth,
                             frame_s=frame_c, step_overhead_s=step_overhead) for d in compute]
    devices += [OffloadDevice(id=d, flops=fast, memory_bandwidth=kv_read / max(attention, 1e-9), memory_bytes=1 << 40,
                              link_bandwidth=bandwidth, frame_s=frame_m) for d in memory]
    problem = OffloadProblem(devices=tuple(devices), model=model,
                             workload=OffloadWorkload(prompt_tokens=prompt_tokens, generated_tokens=generated_tokens))
    figures = {"dense_layer": dense, "attention_layer": attention, "frame_compute": frame_c, "frame_memory": frame_m,
               "head_flops": head, "step_overhead": step_overhead, "layer_cycle": c.get("layer_cycle", 0.0),
               "step": c.get("step_period", 0.0), "host_share": f}
    if host_cores is not None:
        figures["background"] = background
        figures["memory_share"] = f_memory
    return Calibration(problem=problem, figures=figures)


def _renumbered(events: Sequence[TimelineEvent], run: int) -> list[TimelineEvent]:
    """A run's events with micro-batch ids of their own, so pooled runs' chains stay apart."""
    return [msgspec.structs.replace(e, micro_batch=e.micro_batch + 1000 * run) for e in events]


def background_for_share(problem: OffloadProblem, plan, share: float, *, device: str, host_cores: int,
                         generated_tokens: int, mode: str | None = None, high: float = 64.0) -> float:
    """The background (other runnable processes) under which the simulated run of ``plan`` gives
    ``device`` the ``share`` of a core a real run's scheduler reported for it (CPU / (CPU + run-queue
    wait)): the host's load during that run, with the run's own agents' sharing taken out by the
    simulator. Bisection (the share falls as the background grows); 0 when even none gives less."""
    from core.techniques.attention_offload.simulator import simulate

    if not 0.0 < share <= 1.0:
        raise ValueError("share is a share of a core: in (0, 1]")

    def got(background: float) -> float:
        return simulate(problem, plan, mode, generated_tokens=generated_tokens, host_cores=host_cores,
                        background=background).core_share(device)

    lo, hi = 0.0, high
    if got(lo) <= share:
        return 0.0
    if got(hi) >= share:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if got(mid) > share else (lo, mid)
    return (lo + hi) / 2
