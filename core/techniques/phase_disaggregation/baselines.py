"""The baselines EPD is compared with, and the strategies Compare lists (search first).

- **aggregated**: every device runs whole requests (encode, prefill and decode on one device,
  prefill-first between decode steps), as a vLLM-style server without disaggregation.
- **pd-only**: prefill and decode pools, the encoder coupled to prefill (DistServe-style).

Each baseline uses the whole device budget and the best of a small grid of its own knobs
(decode batch, prefill batch, and for pd-only the prefill/decode split), so it is tuned, not a
straw man; ``search`` starts from both, so it never returns less goodput than either.
"""

from __future__ import annotations

import time

import msgspec

from core.errors import EdgeShardError
from core.reporting import Reporter
from core.techniques.outcomes import StrategyOutcome
from core.techniques.phase_disaggregation.search import (
    SERVED_BATCHES, Candidate, config_for, device_orders, evaluate, search,
)
from core.techniques.phase_disaggregation.types import EpdInputError, EpdProblem, PoolConfig

DECODE_GRID = (8, 32)
PREFILL_GRID = (1, 4)


def _best(problem: EpdProblem, configs: list[PoolConfig]) -> Candidate:
    return max((evaluate(problem, c) for c in configs), key=lambda c: c.score)


def aggregated(problem: EpdProblem, *, served_only: bool = False) -> Candidate:
    """``served_only``: prefill batches the real run serves (1) only."""
    n = len(problem.devices)
    return _best(problem, [config_for(problem, "aggregated", (n,), decode_batch=db, prefill_batch=pb)
                           for db in DECODE_GRID for pb in _prefill_grid(served_only)])


def _prefill_grid(served_only: bool) -> tuple[int, ...]:
    return SERVED_BATCHES["prefill_batch"] if served_only else PREFILL_GRID


def pd_only(problem: EpdProblem, *, served_only: bool = False) -> Candidate:
    n = len(problem.devices)
    if n < 2:
        raise EpdInputError("pd-only needs at least 2 devices (a prefill and a decode pool)")
    splits = sorted({max(1, min(n - 1, round(n * f))) for f in (0.25, 0.5, 0.75)})
    return _best(problem, list({config_for(problem, "pd", (p, n - p), decode_batch=db, prefill_batch=pb, order=o): 0
                                for o in device_orders(problem) for p in splits for db in DECODE_GRID
                                for pb in _prefill_grid(served_only)}))


def searched(problem: EpdProblem, *, trials: int = 40, time_limit_s: float = 120.0, seed: int = 0,
             reporter: Reporter | None = None) -> Candidate:
    """The optimiser's pick, seeded with both baselines."""
    seeds = [aggregated(problem).config] + ([pd_only(problem).config] if len(problem.devices) >= 2 else [])
    return search(problem, trials=trials, time_limit_s=time_limit_s, seed=seed, seeds=seeds,
                  reporter=reporter).best


class ScaleRow(msgspec.Struct, frozen=True, kw_only=True):
    strategy: str
    candidate: Candidate
    ttft_p50_s: float
    """Median TTFT at the comparison's common rate."""
    attainment: float
    """SLO attainment at that rate."""


class ScaleComparison(msgspec.Struct, frozen=True, kw_only=True):
    """EPD's search pick, aggregated and PD-only on one problem: goodput each, TTFT at one rate."""

    rate_rps: float
    rows: tuple[ScaleRow, ...]
    search_s: float
    trials: int


def compare_at_scale(problem: EpdProblem, *, trials: int = 40, time_limit_s: float = 300.0, seed: int = 0,
                     reporter: Reporter | None = None) -> ScaleComparison:
    """Baselines, the search seeded with them, and every pick's median TTFT at one common rate:
    PD-only's goodput (where the coupled design just meets the SLO), or a tenth of the search's
    when PD-only meets it at no rate."""
    from core.techniques.phase_disaggregation.goodput import rate_point

    agg, pd = aggregated(problem), pd_only(problem)
    result = search(problem, trials=trials, time_limit_s=time_limit_s, seed=seed, seeds=[agg.config, pd.config],
                    reporter=reporter)
    rate = pd.goodput_rps if pd.goodput_rps > 0 else max(result.best.goodput_rps / 10, 1e-3)
    rows = []
    for name, cand in (("search", result.best), ("aggregated", agg), ("pd-only", pd)):
        point = rate_point(problem.costs, problem.workload, cand.config, problem.slo, rate)
        rows.append(ScaleRow(strategy=name, candidate=cand, ttft_p50_s=point.ttft_p50_s, attainment=point.attainment))
    return ScaleComparison(rate_rps=rate, rows=tuple(rows), search_s=result.elapsed_s, trials=len(result.candidates))


class EpdOutcome(StrategyOutcome, frozen=True, kw_only=True):
    """One strategy's row in Compare."""

    plan: PoolConfig | None = None
    candidate: Candidate | None = None
    mean_output_tokens: float = 0.0

    @property
    def latency_s(self) -> float | None:
        """Median TTFT at the workload's rate."""
        return self.candidate.ttft_p50_s if self.candidate else None

    @property
    def tokens_per_s(self) -> float | None:
        """Goodput in output tokens per second (requests per second × mean output length)."""
        if not self.candidate:
            return None
        return self.candidate.goodput_rps * self.mean_output_tokens


STRATEGIES = {"search": searched, "pd-only": pd_only, "aggregated": aggregated}


def run_strategy(problem: EpdProblem, name: str, objective: str = "throughput", time_limit_s: float = 30.0, *,
                 reporter: Reporter | None = None) -> EpdOutcome:
    """One strategy; operator errors become ``failed``."""
    t0 = time.perf_counter()
    try:
        if name not in STRATEGIES:
            raise EpdInputError(f"unknown EPD strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        fn = STRATEGIES[name]
        cand = fn(problem, time_limit_s=time_limit_s, reporter=reporter) if name == "search" else fn(problem)
    except EdgeShardError as err:
        return EpdOutcome.failed(name, objective, str(err), started=t0)
    reqs = problem.workload.requests
    return EpdOutcome(strategy=name, objective=objective, status="ok", plan=cand.config, candidate=cand,
                      elapsed_s=time.perf_counter() - t0,
                      mean_output_tokens=sum(r.output_tokens for r in reqs) / len(reqs))


__all__ = ["EpdOutcome", "STRATEGIES", "ScaleComparison", "ScaleRow", "aggregated", "compare_at_scale", "pd_only",
           "run_strategy", "searched"]
