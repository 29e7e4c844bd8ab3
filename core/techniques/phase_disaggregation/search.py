"""The configuration search: a black-box optimiser (optuna's TPE) over the simulator, maximising
goodput with the fewest devices under the problem's SLO and device budget.

The space: how requests are served (``epd``, ``pd``, ``aggregated``), each pool's size (their
sum within the budget), encode / prefill / decode batch sizes, the IRP degree (up to the encode
pool's size) and the scheduling policy. A trial's value is its goodput (``goodput.goodput``,
a bisection of simulations) less at most 2 % for using the whole budget, so of two
configurations within the bisection's tolerance the one with fewer devices wins. Configurations
given as ``seeds`` (the baselines) are evaluated first, so the search never returns anything
worse than them.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from core.reporting import Cancelled, NullReporter, Reporter
from core.techniques.phase_disaggregation.goodput import goodput
from core.techniques.phase_disaggregation.memory import over_budget, problem_memory
from core.techniques.phase_disaggregation.simulator import simulate_pools
from core.techniques.phase_disaggregation.types import (
    DISAGGREGATIONS, POLICIES, EpdInputError, EpdProblem, PoolConfig,
)
from core.techniques.phase_disaggregation.workload import mean_rate_rps

if TYPE_CHECKING:
    import optuna  # imported by search() only: the studio's start-up does not pay for it (~0.3 s)

ENCODE_BATCHES = (1, 2, 4)
PREFILL_BATCHES = (1, 2, 4, 8)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SERVED_BATCHES = {"encode_batch": (1,), "prefill_batch": (1,)}
"""What the real run serves (``runtime.check_real_pools``): ``served_only`` searches only these."""
DEVICE_PENALTY = 0.02
"""A configuration using the whole budget scores this fraction below its goodput."""
ORDERED_MAX = 5
"""Up to this many devices with speeds of their own, the search also picks which device serves
which pool (every order: 120 at 5); beyond it the pools take the problem's order."""


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluated configuration."""

    config: PoolConfig
    goodput_rps: float
    ttft_p50_s: float
    """Median TTFT at the workload's own rate."""
    tpot_p50_s: float
    score: float
    memory_bytes: int = 0
    """The most memory one of its devices needs (``memory.device_memory``; 0: the problem has no weights)."""
    fits: bool = True
    """Whether every device's need is within the problem's memory budget (if not: not simulated, goodput 0)."""

    @property
    def devices(self) -> int:
        return len(self.config.devices)


class SearchProgress(msgspec.Struct, frozen=True, kw_only=True):
    """What a reporter's ``partial_result`` gets after each trial (the studio's progress chart)."""

    trial: int
    trials: int
    candidate: Candidate
    best: Candidate


class SearchResult(msgspec.Struct, frozen=True, kw_only=True):
    best: Candidate
    candidates: tuple[Candidate, ...]
    """Every configuration evaluated, in the order tried."""
    elapsed_s: float
    sampler: str = "optuna TPE"


def min_devices(mode: str) -> int:
    return {"epd": 3, "pd": 2, "aggregated": 1}[mode]


def device_orders(problem: EpdProblem) -> tuple[tuple[str, ...], ...]:
    """The device orders pools are taken from: the problem's own when every device runs at the
    same speeds (order changes nothing), every order when the costs time devices apart
    (``PhaseCosts.devices``: a phase on the slow agent is slow), up to ``ORDERED_MAX`` devices."""
    if not problem.costs.devices or len(problem.devices) > ORDERED_MAX:
        return (problem.devices,)
    return tuple(itertools.permutations(problem.devices))


def config_for(problem: EpdProblem, mode: str, sizes: Sequence[int], *, encode_batch: int = 1,
               prefill_batch: int = 1, decode_batch: int = 8, irp_degree: int = 1,
               policy: str = "fcfs", order: Sequence[str] | None = None) -> PoolConfig:
    """Pools from the problem's devices in order (or in ``order``, one of ``device_orders``):
    ``sizes`` are (encode, prefill, decode) for ``epd``, (prefill, decode) for ``pd`` and (pool,)
    for ``aggregated``."""
    need = sum(sizes)
    if need > len(problem.devices):
        raise EpdInputError(f"{mode} with pools of {'+'.join(map(str, sizes))} devices needs {need}; the problem "
                            f"has {len(problem.devices)}")
    devs = tuple(order) if order is not None else problem.devices
    caches = dict(mm_cache_tokens=problem.mm_cache_tokens, kv_cache_tokens=problem.kv_cache_tokens)
    knobs = dict(encode_batch=encode_batch, prefill_batch=prefill_batch, decode_batch=decode_batch, policy=policy)
    if mode == "epd":
        e, p, d = sizes
        return PoolConfig(disaggregation="epd", encode=devs[:e], prefill=devs[e:e + p], decode=devs[e + p:e + p + d],
                          irp_degree=irp_degree, **knobs, **caches)
    if mode == "pd":
        p, d = sizes
        return PoolConfig(disaggregation="pd", encode=devs[:p], prefill=devs[:p], decode=devs[p:p + d], **knobs,
                          **caches)
    (n,) = sizes
    return PoolConfig(disaggregation="aggregated", encode=devs[:n], prefill=devs[:n], decode=devs[:n], **knobs,
                      **caches)


def evaluate(problem: EpdProblem, config: PoolConfig) -> Candidate:
    """Goodput by bisection, and the median TTFT / TPOT at the workload's own rate; a configuration
    whose devices need more memory than the problem's budget is not simulated (goodput 0, unfit)."""
    problem.check_config(config)
    need = problem_memory(problem, config)
    memory_bytes = max(need.values(), default=0)
    if over_budget(need, problem.memory_budget_bytes):
        return Candidate(config=config, goodput_rps=0.0, ttft_p50_s=0.0, tpot_p50_s=0.0, score=-1.0,
                         memory_bytes=memory_bytes, fits=False)
    g = goodput(problem.costs, problem.workload, config, problem.slo, start_rps=mean_rate_rps(problem.workload))
    ms = simulate_pools(problem.costs, problem.workload, config).metrics
    score = g.rate_rps * (1 - DEVICE_PENALTY * len(config.devices) / len(problem.devices))
    return Candidate(config=config, goodput_rps=g.rate_rps, ttft_p50_s=statistics.median(m.ttft_s for m in ms),
                     tpot_p50_s=statistics.median(m.tpot_s for m in ms), score=score, memory_bytes=memory_bytes)


def _suggest(trial: optuna.Trial, problem: EpdProblem, modes: Sequence[str], served_only: bool = False) -> PoolConfig:
    n = len(problem.devices)
    mode = trial.suggest_categorical("mode", list(modes))
    orders = device_orders(problem)
    order = orders[trial.suggest_categorical("order", list(range(len(orders))))] if len(orders) > 1 else None
    encode, prefill = ((SERVED_BATCHES["encode_batch"], SERVED_BATCHES["prefill_batch"]) if served_only
                       else (ENCODE_BATCHES, PREFILL_BATCHES))
    knobs = dict(encode_batch=trial.suggest_categorical("encode_batch", list(encode)),
                 prefill_batch=trial.suggest_categorical("prefill_batch", list(prefill)),
                 decode_batch=trial.suggest_categorical("decode_batch", list(DECODE_BATCHES)),
                 policy=trial.suggest_categorical("policy", list(POLICIES)))
    if mode == "epd":
        e = trial.suggest_int("encode_n", 1, n - 2)
        p = trial.suggest_int("prefill_n", 1, n - e - 1)
        d = trial.suggest_int("decode_n", 1, n - e - p)
        irp = trial.suggest_int("irp", 1, e)
        return config_for(problem, "epd", (e, p, d), irp_degree=irp, order=order, **knobs)
    if mode == "pd":
        p = trial.suggest_int("prefill_n", 1, n - 1)
        d = trial.suggest_int("decode_n", 1, n - p)
        return config_for(problem, "pd", (p, d), order=order, **knobs)
    return config_for(problem, "aggregated", (trial.suggest_int("pool_n", 1, n),), order=order, **knobs)


def params_of(config: PoolConfig, orders: Sequence[tuple[str, ...]] = ()) -> dict:
    """The optimiser's parameters that make ``config`` (to evaluate a given configuration first);
    with several ``orders`` (``device_orders``), the first whose lead is the config's devices."""
    out = dict(mode=config.disaggregation, encode_batch=config.encode_batch, prefill_batch=config.prefill_batch,
               decode_batch=config.decode_batch, policy=config.policy)
    if len(orders) > 1:
        used = config.devices
        out["order"] = next((i for i, o in enumerate(orders) if o[:len(used)] == used), 0)
    if config.disaggregation == "epd":
        out |= dict(encode_n=len(config.encode), prefill_n=len(config.prefill), decode_n=len(config.decode),
                    irp=config.irp_degree)
    elif config.disaggregation == "pd":
        out |= dict(prefill_n=len(config.prefill), decode_n=len(config.decode))
    else:
        out |= dict(pool_n=len(config.prefill))
    return out


def search(problem: EpdProblem, *, modes: Sequence[str] = DISAGGREGATIONS, trials: int = 40,
           time_limit_s: float = 120.0, seed: int = 0, seeds: Sequence[PoolConfig] = (),
           served_only: bool = False, reporter: Reporter | None = None) -> SearchResult:
    """The best configuration found in ``trials`` trials or ``time_limit_s``, whichever ends first;
    ``served_only``: only batch sizes the real run serves (the studio's measured cluster)."""
    reporter = reporter or NullReporter()
    bad = [m for m in modes if m not in DISAGGREGATIONS]
    if bad or not modes:
        raise EpdInputError(f"unknown disaggregation(s) {', '.join(bad) or '(none given)'}; choose from "
                            f"{', '.join(DISAGGREGATIONS)}")
    modes = [m for m in modes if min_devices(m) <= len(problem.devices)]
    if not modes:
        raise EpdInputError(f"{len(problem.devices)} device(s) are too few for the chosen disaggregation(s): epd "
                            "needs 3, pd 2")
    if trials < 1 or time_limit_s <= 0:
        raise EpdInputError("the search needs at least one trial and a time limit > 0")
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    for cfg in seeds:
        if cfg.disaggregation in modes:
            study.enqueue_trial(params_of(cfg, device_orders(problem)), skip_if_exists=True)
    seen: dict[tuple, Candidate] = {}
    order: list[Candidate] = []
    t0 = time.perf_counter()
    reporter.status(f"searching {trials} configurations over {', '.join(modes)} with {len(problem.devices)} devices")

    def objective(trial: optuna.Trial) -> float:
        if reporter.cancel_requested():
            raise Cancelled()
        cfg = _suggest(trial, problem, modes, served_only)
        key = msgspec.json.encode(cfg)
        cand = seen.get(key) or evaluate(problem, cfg)
        seen[key] = cand
        order.append(cand)
        best = max(order, key=lambda c: c.score)
        reporter.status(f"trial {len(order)}/{trials}: {cfg.disaggregation} on {cand.devices} device(s), goodput "
                        f"{cand.goodput_rps:.3g} req/s (best {best.goodput_rps:.3g})")
        reporter.progress(len(order), trials)
        reporter.partial_result(SearchProgress(trial=len(order), trials=trials, candidate=cand, best=best))
        return cand.score

    study.optimize(objective, n_trials=trials, timeout=time_limit_s, catch=())
    if not order:
        raise EpdInputError("the search ran out of time before its first trial: give it more time")
    fitting = [c for c in order if c.fits]
    if not fitting:
        smallest = min(order, key=lambda c: c.memory_bytes)
        raise EpdInputError(f"none of the {len(order)} configurations tried fits the devices' memory: "
                            f"{over_budget(problem_memory(problem, smallest.config), problem.memory_budget_bytes)}")
    return SearchResult(best=max(fitting, key=lambda c: c.score), candidates=tuple(order),
                        elapsed_s=time.perf_counter() - t0)


__all__ = ["SERVED_BATCHES", "Candidate", "SearchProgress", "SearchResult", "config_for", "device_orders", "evaluate", "min_devices",
           "params_of",
           "search"]
