"""Attention offloading's per-device costs measured on the agents: a short probe run of the technique.

Why not the layer-sharding profile alone (``measured.problem_from_profile``): it times whole decoder
blocks, and on a small model on a CPU a block's time is mostly per-call work (a dozen torch ops
dispatched), not FLOPs or bytes. Dividing FLOPs and bytes by it gave speeds under which a 16-token
prefill took 16 decode steps and a memory agent's attention over a few KB of KV a few µs, while
that agent's attend (the KV append, SDPA, per frame) took ~0.3 ms of CPU: on the demo cluster the
Run screen predicted the memory agent's lane at 0.04× what it measured and the compute lane at
1.5×. The attention a memory agent performs is nowhere in a layer-sharding profile.

The probe runs the technique itself for a few steps (``run_offload``: one compute agent, the
memory agents, ``PROBE_BATCH`` × ``PROBE_PROMPT_TOKENS`` tokens, ``PROBE_NEW_TOKENS`` steps) and
``fit_devices`` reads each memory agent's attention span off that run's own events: less the KV
read the cost model charges (bytes over its profiled bandwidth), it is the attend's per-frame work
(``frame_s``, a frame received and one answered). The compute side keeps the profile's figures
(``measured``: a roofline from its decode and prefill), as do budgets and links.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec

from agents.protocol import TimelineEvent
from core.techniques.attention_offload.problem import OffloadProblem

PROBE_BATCH = 2
PROBE_PROMPT_TOKENS = 8
PROBE_NEW_TOKENS = 6
"""The probe's run: ~1 s on the demo (its compute agent is 8× slowed), 4 decode steps × every layer
per memory agent read (``FIRST_STEP`` on)."""
FIRST_STEP = 2
"""Steps 0 (the prefill) and 1 (the first decode step, its caches cold) are not read."""
QUANTILE = 0.25
"""Each memory agent's attention is read at this quantile of its spans: what the device does when
the host does not preempt it. An emulated device's span is its CPU time × its slowdown or its wall
time, whichever is longer; on a busy host (load 16 on 2 cores) half of a 1.5×-slowed agent's
attentions waited 3–5 ms for a core beside 0.4–0.6 ms of work, so their median swung 0.8–3.8 ms
from one probe to the next, while the lower quartile stayed 0.45–0.55 ms. The profile, too, times
devices as they compute when not preempted (thread CPU time × slowdown)."""


class ProbeFit(msgspec.Struct, frozen=True, kw_only=True):
    problem: OffloadProblem
    """The problem with each memory agent's ``frame_s`` measured (everything else as it was)."""
    attention_s: dict[str, float]
    """Per memory agent: its attention span as read (``QUANTILE``), seconds."""

    def onto(self, problem: OffloadProblem) -> OffloadProblem:
        """``problem`` (this run's workload) with the probed agents' ``frame_s``: a fit kept from an
        earlier run must not bring back that run's workload with it."""
        fitted = {m: self.problem.device(m).frame_s for m in self.attention_s}
        return msgspec.structs.replace(problem, devices=tuple(
            msgspec.structs.replace(d, frame_s=fitted[d.id]) if d.id in fitted else d for d in problem.devices))


def probe_request(vocab: int, batch: int = PROBE_BATCH, prompt_tokens: int = PROBE_PROMPT_TOKENS,
                  new_tokens: int = PROBE_NEW_TOKENS):
    """The probe's ``RunRequest``: fixed token ids (no tokenizer: ids 3.. spread over the vocabulary),
    no EOS, so every step runs."""
    from core.runs.coordinator import RunRequest

    rows = tuple(tuple(3 + (7 * (b * prompt_tokens + i) + b) % max(1, vocab - 3) for i in range(prompt_tokens))
                 for b in range(batch))
    return RunRequest(input_ids=rows, attention_mask=tuple((1,) * prompt_tokens for _ in rows),
                      max_new_tokens=new_tokens, eos_token_ids=(), pad_token_id=0)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between order statistics (numpy's default rule)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def fit_devices(problem: OffloadProblem, events: Sequence[TimelineEvent], *, memory: Sequence[str], batch: int,
                prompt_tokens: int, first_step: int = FIRST_STEP) -> ProbeFit:
    """``problem`` with each memory agent's per-frame cost read off a probe run's ``events``: its
    attention span (``QUANTILE``) less the KV read the cost model already charges it
    (``cost.attention_seconds_by_device`` at the run's batch and mid-probe context), halved (a frame
    received, one answered). ValueError names an agent with no attention from ``first_step`` on."""
    from core.techniques.attention_offload.cost import attention_seconds_by_device

    spans = {m: [e.end_s - e.start_s for e in events if e.device == m and e.kind == "compute"
                 and e.step >= first_step] for m in memory}
    missing = [m for m in memory if not spans[m]]
    if missing:
        raise ValueError(f"the probe run has no attention on {', '.join(missing)} from decode step {first_step} on")
    steps = sorted({e.step for e in events if e.step >= first_step})
    context = prompt_tokens + statistics.median(steps) - 1  # the KV each decode step reads, mid-probe
    bare = [msgspec.structs.replace(problem.device(m), frame_s=0.0) for m in memory]
    kv_read = attention_seconds_by_device(problem, bare, batch, context)
    attention = {m: quantile(spans[m], QUANTILE) for m in memory}
    fitted = {d.id: msgspec.structs.replace(d, frame_s=max(0.0, attention[d.id] - kv) / 2)
              for d, kv in zip(bare, kv_read)}
    devices = tuple(fitted.get(d.id, d) for d in problem.devices)
    return ProbeFit(problem=msgspec.structs.replace(problem, devices=devices), attention_s=attention)


def busy_s(events: Sequence[TimelineEvent]) -> dict[str, float]:
    """Device -> the seconds its compute spans took (a lane's busy time: what the Run screen's lane
    labels compare, predicted against measured)."""
    out: dict[str, float] = {}
    for e in events:
        if e.kind == "compute":
            out[e.device] = out.get(e.device, 0.0) + e.end_s - e.start_s
    return out


def probe_on_agents(coordinator, problem: OffloadProblem, model_dir: str, compute: str, memory: Sequence[str], *,
                    reporter=None) -> ProbeFit:
    """Run the probe on the agents (``run_offload``: ``compute`` the compute agent) and fit each of
    ``memory`` from it; in runs of at most the model's key/value heads agents (each holds one at least)."""
    from core.techniques.attention_offload.run import run_offload

    request = probe_request(problem.model.vocab)
    fitted, attention = problem, {}
    for i in range(0, len(memory), problem.model.kv_heads):
        group = list(memory[i:i + problem.model.kv_heads])
        result = run_offload(coordinator, model_dir, compute, group, request, reporter=reporter)
        fit = fit_devices(fitted, result.events, memory=group, batch=len(request.input_ids),
                          prompt_tokens=len(request.input_ids[0]))
        fitted, attention = fit.problem, {**attention, **fit.attention_s}
    return ProbeFit(problem=fitted, attention_s=attention)


__all__ = ["PROBE_BATCH", "PROBE_NEW_TOKENS", "PROBE_PROMPT_TOKENS", "QUANTILE", "ProbeFit", "busy_s", "fit_devices",
           "probe_on_agents", "probe_request", "quantile"]
