"""Attention offloading's strategies: the exact search, Lamina's rule, and the two baselines.

Throughput grows with the batch (dense time is flat until compute-bound, attention is linear
in it), so for fixed devices and n the best batch is the largest the memory holds; the exact
search therefore enumerates device roles (by device type: identical devices are interchangeable)
and n ≤ 2c + 2, and takes that batch. Baselines, priced the same way:
``homogeneous`` — every accelerator alone holds weights and its KV (the paper's baseline);
``layer-sharding`` — all devices in one pipeline, each a contiguous run of layers with their
weights and KV (EdgeShard's placement), split to minimise the slowest stage (exact DP).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from core.errors import EdgeShardError, PlanInvalid
from core.techniques.attention_offload.cost import (
    OffloadCost, attention_seconds, dense_seconds, evaluate, head_seconds,
)
from core.techniques.attention_offload.problem import OffloadDevice, OffloadPlan, OffloadProblem, check_problem
from core.techniques.outcomes import StrategyOutcome

Score = Literal["throughput", "throughput-per-dollar", "latency"]


class BaselinePlan(msgspec.Struct, frozen=True, kw_only=True):
    """A baseline's placement: ``stages`` (device, layers) in pipeline order, per replica."""

    kind: Literal["homogeneous", "layer-sharding"]
    stages: tuple[tuple[str, int], ...]
    replicas: int
    batch: int


class BaselineCost(msgspec.Struct, frozen=True, kw_only=True):
    step_s: float
    tokens_per_s: float
    price: float
    tokens_per_s_per_dollar: float
    fits: bool

    @property
    def latency_s(self) -> float:
        return self.step_s


class OffloadOutcome(StrategyOutcome, frozen=True, kw_only=True):
    plan: OffloadPlan | BaselinePlan | None = None
    cost: OffloadCost | BaselineCost | None = None

    @property
    def latency_s(self) -> float | None:
        return self.cost.step_s if self.cost else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.cost.tokens_per_s if self.cost else None


def score(cost, objective: str) -> float:
    """Larger is better, for every objective."""
    if objective == "latency":
        return -cost.step_s
    if objective == "throughput-per-dollar":
        return cost.tokens_per_s_per_dollar
    return cost.tokens_per_s


def _types(problem: OffloadProblem) -> list[list[OffloadDevice]]:
    groups: dict[tuple, list[OffloadDevice]] = {}
    for d in problem.devices:
        key = (d.flops, d.memory_bandwidth, d.memory_bytes, d.link_bandwidth, d.link_latency_s, d.price)
        groups.setdefault(key, []).append(d)
    return list(groups.values())


def largest_batch(problem: OffloadProblem, memory: list[OffloadDevice], in_flight: int) -> int:
    """The most sequences per batch whose KV (n batches, full context) and one prefill attend's
    transient (linear in the batch) the memory devices hold."""
    m = problem.model
    per_seq_head = problem.workload.context_tokens * 2 * m.layers * m.head_dim * m.bytes_per_element
    base, extra = divmod(m.kv_heads, len(memory))
    shares = [base + (1 if i < extra else 0) for i in range(len(memory))]
    fit = min(d.memory_bytes // (in_flight * h * per_seq_head + m.prefill_attend_bytes(1, problem.workload.prompt_tokens, h))
              for h, d in zip(shares, memory))
    return int(min(fit, problem.workload.max_batch))


def _best_for(problem, compute, memory, objective, schedule, n_values) -> tuple[OffloadPlan, OffloadCost] | None:
    best = None
    for n in n_values:
        batch = largest_batch(problem, memory, n)
        if batch < 1:
            continue
        plan = OffloadPlan(compute=tuple(d.id for d in compute), memory=tuple(d.id for d in memory),
                           batch=batch, in_flight=n, schedule=schedule)
        cost = evaluate(problem, plan)
        if cost.fits and (best is None or score(cost, objective) > score(best[1], objective)):
            best = (plan, cost)
    return best


def exact(problem: OffloadProblem, objective: str = "throughput", schedule: str = "rotational") -> OffloadPlan:
    """The best plan over every split of device types into compute/memory/unused and n ≤ 2c + 2."""
    check_problem(problem)
    types = _types(problem)
    choices = [[(c, k) for c in range(len(t) + 1) for k in range(len(t) + 1 - c)] for t in types]
    best = None
    for combo in itertools.product(*choices):
        compute = [d for t, (c, _) in zip(types, combo) for d in t[:c]]
        memory = [d for t, (c, k) in zip(types, combo) for d in t[c:c + k]]
        if not compute or not memory or len(memory) > problem.model.kv_heads:
            continue
        if any(problem.model.weight_bytes > d.memory_bytes for d in compute):
            continue
        found = _best_for(problem, compute, memory, objective, schedule, range(1, 2 * len(compute) + 3))
        if found and (best is None or score(found[1], objective) > score(best[1], objective)):
            best = found
    if best is None:
        raise EdgeShardError("no attention-offload plan fits: no device holds the dense weights "
                             f"({problem.model.weight_bytes / 2**30:.1f} GiB) with another to hold KV; "
                             "add a device with more memory or use a smaller model")
    return best[0]


def lamina_rule(problem: OffloadProblem, objective: str = "throughput") -> OffloadPlan:
    """Lamina's rule: the fastest devices compute (n = c + 1 batches in flight), and the fewest
    memory devices (by bandwidth) whose attention time t_a ≤ t_m/(n − 1) join the pool."""
    check_problem(problem)
    top = max(d.flops for d in problem.devices)
    compute = [d for d in problem.devices if d.flops == top and problem.model.weight_bytes <= d.memory_bytes]
    rest = sorted((d for d in problem.devices if d not in compute), key=lambda d: -d.memory_bandwidth)
    if not compute or not rest:
        raise EdgeShardError("Lamina's rule needs an accelerator that holds the dense weights and at least one "
                             "other device for the KV cache")
    n = len(compute) + 1
    chosen = None
    for m in range(1, min(len(rest), problem.model.kv_heads) + 1):
        memory = rest[:m]
        batch = largest_batch(problem, memory, n)
        if batch < 1:
            continue
        chosen = OffloadPlan(compute=tuple(d.id for d in compute), memory=tuple(d.id for d in memory),
                             batch=batch, in_flight=n)
        dense = max(dense_seconds(problem, d, batch) for d in compute)
        if attention_seconds(problem, memory, batch, problem.workload.mean_context_tokens) <= dense / (n - 1):
            return chosen
    if chosen is None:
        raise EdgeShardError("the memory devices cannot hold one sequence's KV cache at this context length")
    return chosen


def _stage_fit_batch(problem: OffloadProblem, device: OffloadDevice, layers: int, in_flight: int) -> int:
    m = problem.model
    weights = layers * m.dense_params_per_layer * m.bytes_per_element
    per_seq = in_flight * problem.workload.context_tokens * layers * 2 * m.kv_heads * m.head_dim * m.bytes_per_element
    return max(0, (device.memory_bytes - weights) // per_seq) if per_seq else 0


def _layer_step(problem: OffloadProblem, device: OffloadDevice, batch: int) -> float:
    """One layer with its own KV on ``device``: dense plus attention over its own memory."""
    return dense_seconds(problem, device, batch) + attention_seconds(
        problem, [device], batch, problem.workload.mean_context_tokens)


def baseline_cost(problem: OffloadProblem, plan: BaselinePlan) -> BaselineCost:
    devices = [problem.device(d) for d, _ in plan.stages]
    n = len(plan.stages)  # a pipeline keeps one micro-batch per stage in flight
    times = [layers * _layer_step(problem, d, plan.batch) for d, (_, layers) in zip(devices, plan.stages)]
    times[-1] += head_seconds(problem, devices[-1], plan.batch)  # the last stage runs the head
    hop = sum(plan.batch * problem.model.hidden * problem.model.bytes_per_element / d.link_bandwidth + d.link_latency_s
              for d in devices[:-1])
    step = max(sum(times) + hop, n * max(times))
    tps = plan.replicas * n * plan.batch / step
    price = plan.replicas * sum(d.price for d in devices)
    fits = all(_stage_fit_batch(problem, d, layers, n) >= plan.batch for d, (_, layers) in zip(devices, plan.stages))
    return BaselineCost(step_s=step, tokens_per_s=tps, price=price,
                        tokens_per_s_per_dollar=tps / price if price > 0 else float("inf"), fits=fits)


def homogeneous(problem: OffloadProblem, objective: str = "throughput") -> BaselinePlan:
    """Every accelerator (the fastest devices) alone: weights and its own KV, at its best batch."""
    check_problem(problem)
    top = max(d.flops for d in problem.devices)
    accels = [d for d in problem.devices if d.flops == top]
    batch = min(_stage_fit_batch(problem, accels[0], problem.model.layers, 1), problem.workload.max_batch)
    if batch < 1:
        raise EdgeShardError(f"{accels[0].id} cannot hold the weights and one sequence's KV cache alone")
    return BaselinePlan(kind="homogeneous", stages=((accels[0].id, problem.model.layers),), replicas=len(accels),
                        batch=int(batch))


def layer_sharding(problem: OffloadProblem, objective: str = "throughput") -> BaselinePlan:
    """All devices in one pipeline (fastest first), layers split to minimise the slowest stage at
    each candidate batch (exact DP over contiguous splits); the best batch by ``objective``."""
    check_problem(problem)
    devices = sorted(problem.devices, key=lambda d: -d.flops)
    L, k = problem.model.layers, len(devices)
    best = None
    batch = 1
    while batch <= problem.workload.max_batch:
        per_layer = [_layer_step(problem, d, batch) for d in devices]
        # dp[i][l]: min over splits of the first l layers on the first i devices of the slowest stage
        INF = float("inf")
        dp = [[INF] * (L + 1) for _ in range(k + 1)]
        cut = [[0] * (L + 1) for _ in range(k + 1)]
        dp[0][0] = 0.0
        for i in range(1, k + 1):
            d = devices[i - 1]
            for l in range(L + 1):
                for take in range(0, l + 1):
                    if take and _stage_fit_batch(problem, d, take, k) < batch:
                        break
                    v = max(dp[i - 1][l - take], take * per_layer[i - 1])
                    if v < dp[i][l]:
                        dp[i][l], cut[i][l] = v, take
        if dp[k][L] < INF:
            stages, l = [], L
            for i in range(k, 0, -1):
                take = cut[i][l]
                if take:
                    stages.append((devices[i - 1].id, take))
                l -= take
            plan = BaselinePlan(kind="layer-sharding", stages=tuple(reversed(stages)), replicas=1, batch=batch)
            cost = baseline_cost(problem, plan)
            if cost.fits and (best is None or score(cost, objective) > score(best[1], objective)):
                best = (plan, cost)
        batch *= 2
    if best is None:
        raise EdgeShardError("the devices together cannot hold the model's layers with one sequence's KV cache")
    return best[0]


STRATEGIES: dict[str, Callable[..., object]] = {
    "exact": exact,
    "lamina-rule": lamina_rule,
    "homogeneous": homogeneous,
    "layer-sharding": layer_sharding,
}


def cost_of(problem: OffloadProblem, plan):
    """The one cost entry point for either plan type."""
    return baseline_cost(problem, plan) if isinstance(plan, BaselinePlan) else evaluate(problem, plan)


def run_strategy(problem: OffloadProblem, name: str, objective: str = "throughput", time_limit_s: float = 30.0, *,
                 reporter=None) -> OffloadOutcome:
    """One strategy; ``optimal`` for the exact search, else ``ok``/``oom``; operator errors become ``failed``."""
    t0 = time.perf_counter()
    if not isinstance(problem, OffloadProblem):
        return OffloadOutcome.failed(name, objective,
                                     "attention offloading plans an attention-offload problem (devices with FLOP/s, "
                                     "memory bandwidth and price; see core.techniques.attention_offload.scenarios), "
                                     f"not a {type(problem).__name__}")
    if name not in STRATEGIES:
        return OffloadOutcome.failed(name, objective,
                                     f"unknown strategy {name!r}; attention offloading has {', '.join(STRATEGIES)}")
    try:
        plan = STRATEGIES[name](problem, objective)
        cost = cost_of(problem, plan)
    except (EdgeShardError, PlanInvalid) as err:
        return OffloadOutcome.failed(name, objective, str(err), started=t0)
    status = ("optimal" if name == "exact" else "ok") if cost.fits else "oom"
    return OffloadOutcome(strategy=name, objective=objective, status=status, plan=plan, cost=cost,
                          elapsed_s=time.perf_counter() - t0)
