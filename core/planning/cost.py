"""The one cost and memory model, used by solvers, the plan editor and the simulator.

Notation (EdgeShard, Zhang et al. 2024): a plan has stages j = 0..k-1 on devices d_j
holding units [a_j, b_j). For a step over ``batch`` sequences:

- compute   C_j = Σ_{u in stage j} t(d_j, u) · r_j(u) + o(d_j)
            (decode: t at ``batch``; prefill: at batch × prompt tokens). o is the
            device's once-per-stage overhead (``DeviceTimes.stage_decode_overhead_s`` /
            ``stage_prefill_overhead_s``): the attention mask, positions and rotary
            embedding the runtime builds once per stage and step for all its blocks,
            charged to a stage holding at least one decoder block (0 in older profiles).
            r_j(u): 1, or for a block at int8/int4 weights the measured time ratio of that
            precision (core.planning.precision.unit_time_factors).
            The solvers' arrays (core/planning/solvers/arrays.py) do not include o yet: a plan
            they return is re-evaluated here with it.
- transfer  T_j = O_{b_j - 1} · n / B(d_j, d_{j+1}) + lat(d_j, d_{j+1})
            n = tokens sent: ``batch`` in decode, batch × prompt in prefill; the last
            stage sends the sampled token ids (the head's output) back to the source.
- latency   L = Σ_j C_j + Σ_j T_j                            (eq. 1–2; one decode step)
- prefill   P = the same sum with prefill times and prompt-sized transfers (the returned
            first token ids are ``batch`` tokens, not prompt-sized)
- throughput with micro-batches of m sequences, K of them in flight, no bubbles
            (eq. 9–10): each stage and each link direction serves one micro-batch at a
            time, so the period per micro-batch is the bottleneck
            B = max_j max(C_j(m), occ_j(m)), occ_j = O·m / bandwidth (a link is occupied
            for size/bandwidth; its latency delays but does not occupy). A micro-batch
            cannot start its next step before its token is back: cycle L(m).
            tokens/s = K·m / max(K·B, L(m)).
- memory    M_j = Σ param bytes + Σ kv_bytes_per_token · S · ctx + max_u workspace_bytes_per_token · W
            (param bytes at the stage's weight precision: core.planning.precision)
            S = sequences resident = m · K, ctx = prompt + generated tokens,
            W = tokens processed in one pass (prefill of one micro-batch: m · prompt).
            Must fit budget_j · (1 − memory_headroom).

A plan runs as it says: K micro-batches of m sequences (m · K ≤ the workload's batch).
Latency and prefill are for one micro-batch of m sequences. A latency plan serves the
whole batch at once (m = batch, K = 1).

Times come from the profile through ``core.devices.profile.interpolate``.
"""

from __future__ import annotations

import math

import msgspec

from core.planning.placement import gpu_placement, placed_problem
from core.planning.plan import ShardPlan, Stage
from core.planning.precision import quality_problems, stage_weight_bytes, unit_time_factors
from core.planning.problem import PlanningProblem, usable_memory_bytes
from core.devices.profile import DeviceTimes


class DeviceMemory(msgspec.Struct, frozen=True, kw_only=True):
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes


class PlanCost(msgspec.Struct, frozen=True, kw_only=True):
    latency_per_token_s: float
    """One decode step of a micro-batch (m sequences) through every stage and back (eq. 1–2)."""
    prefill_s: float
    throughput_tokens_s: float
    micro_batch_size: int
    micro_batches: int
    stage_compute_s: tuple[float, ...]
    """Decode compute per stage at the micro-batch size."""
    stage_transfer_s: tuple[float, ...]
    """Decode transfer out of each stage (the last: token ids back to the source)."""
    bottleneck_stage: int
    memory: tuple[DeviceMemory, ...]
    violations: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return not self.violations


def transfer_s(problem: PlanningProblem, src: str, dst: str, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from src to dst (0 on the same device, inf without a link)."""
    if src == dst:
        return 0.0
    link = _links(problem).get((src, dst))
    if link is None:
        return math.inf
    return link.transfer_s(nbytes)


def link_occupancy_s(problem: PlanningProblem, src: str, dst: str, nbytes: float) -> float:
    """Seconds the src→dst link is busy with ``nbytes`` (size / bandwidth, no latency)."""
    if src == dst:
        return 0.0
    link = _links(problem).get((src, dst))
    if link is None:
        return math.inf
    return nbytes * 8.0 / (link.bandwidth_mbit_s * 1e6)


# One-entry caches keyed by object identity: (object, index). A tuple is swapped in
# whole, so concurrent callers (GUI preview, workers) never see a mismatched pair.
_link_cache: tuple = (None, {})
_times_cache: tuple = (None, {})
_memory_cache: tuple = (None, {})


def _links(problem: PlanningProblem) -> dict:
    """The cluster's links by (src, dst), built once per cluster object (values are immutable)."""
    global _link_cache
    cluster = problem.profile.cluster
    cached = _link_cache
    if cached[0] is not cluster:
        cached = _link_cache = (cluster, cluster.link_index())
    return cached[1]


def _times(problem: PlanningProblem, device: str) -> DeviceTimes:
    global _times_cache
    profile = problem.profile
    cached = _times_cache
    if cached[0] is not profile:
        cached = _times_cache = (profile, {t.device: t for t in profile.times})
    try:
        return cached[1][device]
    except KeyError:
        raise KeyError(device) from None


def _device_memory(problem: PlanningProblem, device: str) -> int:
    global _memory_cache
    cluster = problem.profile.cluster
    cached = _memory_cache
    if cached[0] is not cluster:
        cached = _memory_cache = (cluster, {d.id: d.memory_bytes for d in cluster.devices})
    return cached[1][device]


def stage_compute_s(times: DeviceTimes, stage: Stage, phase: str, tokens: int, factors=None) -> float:
    """Compute time of a stage: decode over ``tokens`` sequences, or prefill of ``tokens``,
    plus the device's once-per-stage overhead (the module docstring's o). ``factors``: per unit,
    what its time is multiplied by at the stage's weight precision (``unit_time_factors``)."""
    overhead = times.stage_overhead_time(phase, stage.start, stage.end)
    time_of = times.decode_time if phase == "decode" else times.prefill_time
    if factors is None:
        return sum(time_of(u, tokens) for u in range(stage.start, stage.end)) + overhead
    return sum(time_of(u, tokens) * factors[u] for u in range(stage.start, stage.end)) + overhead


def _factors(problem: PlanningProblem, stage: Stage, phase: str):
    """The stage's per-unit time factors at its precision (None at fp: the profiled times as they are)."""
    return None if stage.weights == "fp" else unit_time_factors(problem.profile, stage.weights, phase, stage.device)


def stage_output_bytes(problem: PlanningProblem, stage: Stage, tokens: int) -> int:
    """Bytes a stage sends on for ``tokens`` tokens: the output of its last unit."""
    return problem.profile.model.units[stage.end - 1].activation_bytes_per_token * tokens


def next_device(plan: ShardPlan, j: int) -> str:
    """Where stage j sends its output: the next stage, or the source for the last one."""
    return plan.stages[j + 1].device if j + 1 < len(plan.stages) else plan.stages[0].device


def link_bytes_per_token(problem: PlanningProblem, plan: ShardPlan) -> dict[tuple[str, str], int]:
    """(src, dst) → bytes the link carries per generated token of one sequence (a decode step):
    each stage's output to the next stage, the last stage's token back to the source. A
    one-stage plan moves nothing. What the Cluster screen draws as predicted traffic."""
    out: dict[tuple[str, str], int] = {}
    for j, st in enumerate(plan.stages):
        dst = next_device(plan, j)
        if dst != st.device:
            out[(st.device, dst)] = out.get((st.device, dst), 0) + stage_output_bytes(problem, st, 1)
    return out


def step_time_s(problem: PlanningProblem, plan: ShardPlan, phase: str, batch: int) -> float:
    """One full step (prefill or one decode token) of ``batch`` sequences: eq. (1)–(2)."""
    prompt = problem.workload.prompt_tokens
    total = 0.0
    for j, st in enumerate(plan.stages):
        times = _times(problem, st.device)
        tokens = batch if phase == "decode" else batch * prompt
        total += stage_compute_s(times, st, phase, tokens, _factors(problem, st, phase))
        last = j == len(plan.stages) - 1
        sent = batch if (phase == "decode" or last) else batch * prompt
        total += transfer_s(problem, st.device, next_device(plan, j), stage_output_bytes(problem, st, sent))
    return total


def memory_of(problem: PlanningProblem, plan: ShardPlan, sequences: int, pass_sequences: int) -> tuple[DeviceMemory, ...]:
    """Memory per stage device; ``sequences`` resident in KV, ``pass_sequences`` per prefill pass."""
    model = problem.profile.model
    ctx = problem.workload.context_tokens
    pass_tokens = pass_sequences * problem.workload.prompt_tokens
    out = []
    for st in plan.stages:
        units = model.units[st.start:st.end]
        out.append(
            DeviceMemory(
                device=st.device,
                weights_bytes=stage_weight_bytes(model, st.start, st.end, st.weights),
                kv_cache_bytes=sum(u.kv_bytes_per_token for u in units) * sequences * ctx,
                workspace_bytes=max((u.workspace_bytes_per_token for u in units), default=0) * pass_tokens,
                budget_bytes=usable_memory_bytes(problem, _device_memory(problem, st.device)),
            )
        )
    return tuple(out)


def structural_violations(problem: PlanningProblem, plan: ShardPlan) -> list[str]:
    """Every rule of the plan's shape that is broken (coverage, order, devices, source)."""
    out: list[str] = []
    n = problem.profile.model.num_units
    known = set(problem.profile.cluster.device_ids())
    timed = {t.device for t in problem.profile.times}
    if plan.num_units != n:
        out.append(f"plan is for {plan.num_units} units but the model has {n}")
    if not plan.stages:
        return out + ["plan has no stages"]
    if plan.stages[0].device != problem.source:
        out.append(f"stage 0 runs on {plan.stages[0].device!r}, but the prompt's source device is {problem.source!r}")
    pos = 0
    seen: set[str] = set()
    for j, st in enumerate(plan.stages):
        if st.start != pos:
            out.append(f"stage {j} starts at unit {st.start}, expected {pos} (stages must cover units in order without gaps)")
        if st.end <= st.start:
            out.append(f"stage {j} on {st.device!r} is empty ([{st.start}, {st.end}))")
        pos = max(pos, st.end)
        if st.device not in known:
            out.append(f"stage {j}: unknown device {st.device!r}")
        elif st.device not in timed:
            out.append(f"stage {j}: no compute times profiled for {st.device!r}")
        if st.device in seen:
            out.append(f"stage {j}: device {st.device!r} is used by more than one stage")
        seen.add(st.device)
        if st.device in problem.excluded_devices:
            out.append(f"stage {j}: device {st.device!r} is excluded")
    if pos != n:
        out.append(f"stages end at unit {pos}, but the model has {n} units")
    links = _links(problem)
    for j, st in enumerate(plan.stages):
        nxt = next_device(plan, j)
        if nxt != st.device and (st.device, nxt) not in links and st.device in known and nxt in known:
            out.append(f"no link from {st.device!r} to {nxt!r}")
    return out


def throughput_tokens_s(problem: PlanningProblem, plan: ShardPlan, m: int, k: int) -> tuple[float, int, list[float], list[float]]:
    """tokens/s for K=k micro-batches of m sequences (no bubbles), plus per-stage terms."""
    comp, xfer, occ = [], [], []
    for j, st in enumerate(plan.stages):
        comp.append(stage_compute_s(_times(problem, st.device), st, "decode", m, _factors(problem, st, "decode")))
        nb = stage_output_bytes(problem, st, m)
        nxt = next_device(plan, j)
        xfer.append(transfer_s(problem, st.device, nxt, nb))
        occ.append(link_occupancy_s(problem, st.device, nxt, nb))
    periods = [max(c, o) for c, o in zip(comp, occ)]
    bottleneck = max(range(len(periods)), key=lambda j: periods[j])
    cycle = sum(comp) + sum(xfer)
    denom = max(k * periods[bottleneck], cycle)
    tput = 0.0 if denom == math.inf or denom <= 0 else k * m / denom
    return tput, bottleneck, comp, xfer


def evaluate(problem: PlanningProblem, plan: ShardPlan) -> PlanCost:
    """Predicted latency, prefill, throughput and memory of a plan, with every violation.

    Everything is for the plan's micro-batch size m and count K: latency and prefill of
    one micro-batch, throughput of K in flight, memory for m · K resident sequences. A stage on a GPU
    is costed with that GPU's times and memory (core.planning.placement).
    """
    problem = placed_problem(problem, gpu_placement(plan))
    violations = structural_violations(problem, plan)
    wl = problem.workload
    m, k = plan.micro_batch_size, plan.micro_batches
    if m < 1 or k < 1:
        violations.append(f"micro-batch size ({m}) and count ({k}) must be at least 1")
    elif m * k > wl.batch_size:
        violations.append(
            f"{k} micro-batches of {m} sequences exceed the workload's batch of {wl.batch_size}"
        )
    if violations and any("unknown device" in v or "no compute times" in v or "units" in v or "at least 1" in v for v in violations):
        return PlanCost(
            latency_per_token_s=math.inf, prefill_s=math.inf, throughput_tokens_s=0.0,
            micro_batch_size=m, micro_batches=k, stage_compute_s=(), stage_transfer_s=(),
            bottleneck_stage=0, memory=(), violations=tuple(violations),
        )
    violations.extend(quality_problems(problem, plan))
    memory = memory_of(problem, plan, m * k, m)
    for mem in memory:
        if not mem.fits:
            violations.append(
                f"{mem.device}: needs {format_bytes(mem.total_bytes)} (weights {format_bytes(mem.weights_bytes)}, "
                f"KV cache {format_bytes(mem.kv_cache_bytes)}, workspace {format_bytes(mem.workspace_bytes)}) "
                f"but its budget is {format_bytes(mem.budget_bytes)}"
            )
    tput, bottleneck, comp, xfer = throughput_tokens_s(problem, plan, m, k)
    return PlanCost(
        latency_per_token_s=sum(comp) + sum(xfer),
        prefill_s=step_time_s(problem, plan, "prefill", m),
        throughput_tokens_s=tput,
        micro_batch_size=m,
        micro_batches=k,
        stage_compute_s=tuple(comp),
        stage_transfer_s=tuple(xfer),
        bottleneck_stage=bottleneck,
        memory=memory,
        violations=tuple(violations),
    )


def validate(problem: PlanningProblem, plan: ShardPlan) -> list[str]:
    """Every violated constraint (shape and memory), in plain words; empty when valid."""
    return list(evaluate(problem, plan).violations)


def byte_unit(n: float) -> tuple[str, int]:
    """The unit a size reads in (GiB, MiB, KiB, B) and its bytes: a few-MiB model is not "0.00 GiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return unit, size
    return "B", 1


def format_bytes(n: float) -> str:
    unit, size = byte_unit(n)
    return f"{int(n)} B" if size == 1 else f"{n / size:.2f} {unit}"
