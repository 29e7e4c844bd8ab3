"""EPD planned from the connected agents and run on them (the studio's measured source).

The paper-shaped problem (``scenarios``: eight illustrative devices) answers "what if"; this
module answers "what should *these* agents do": ``measure_costs`` times the phases on the
agents themselves (``profiling.profile_phases`` over a layout that puts each phase on its own
agent where there are enough of them), ``cluster_problem`` is the search's problem over exactly
those agents, with a workload the real run can serve (``agent_workload``), and ``run_layout``
serves that workload with a chosen layout (the search's pick, PD-only or aggregated), records
it beside the simulator's prediction for the same costs, and returns the SLO figures of both.
Every check that needs no agent runs before any agent is set to work (``served_problem``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import msgspec

from core.reporting import Cancelled, NullReporter, Reporter
from core.techniques.phase_disaggregation.types import (
    SLO, DevicePhaseCosts, EpdInputError, EpdProblem, PhaseCosts, PoolConfig, RequestMetrics, Workload,
)

PROBE_TILES = (1, 2, 4)
PROBE_PROMPTS = (16, 48)
PROBE_BATCHES = (1, 2, 4)
"""What ``measure_costs`` probes: sizes a small checkpoint's shipped prompts and tiles reach,
so a measurement of every phase on every agent takes seconds."""


def measurement_pools(devices: Sequence[str]) -> PoolConfig:
    """Where the phases are timed: encode, prefill and decode each on its own agent when there are
    three or more (so the data-plane hops are timed too), else shared by the few there are."""
    devs = list(devices)
    if not devs:
        raise EpdInputError("no agents to measure on: start the demo cluster or connect agents")
    e, p, d = devs[0], devs[min(1, len(devs) - 1)], devs[min(2, len(devs) - 1)]
    mode = "epd" if len({e, p, d}) == 3 else ("pd" if e != d else "aggregated")
    if mode == "pd":
        p = e  # PD-only couples encode to prefill
    return PoolConfig(disaggregation=mode, encode=(e,), prefill=(p,), decode=(d,), decode_batch=max(PROBE_BATCHES))


def measurement_rotations(devices: Sequence[str]) -> list[PoolConfig]:
    """Every rotation of the devices through ``measurement_pools``: over them each agent serves each
    phase once (encode on the i-th, prefill on the next, decode on the one after), so every phase is
    timed on every agent (a single agent: the one aggregated layout)."""
    devs = list(devices)
    if len(devs) <= 1:
        return [measurement_pools(devs)]
    return [measurement_pools(devs[r:] + devs[:r]) for r in range(len(devs))]


def measure_costs(link, model_dir: str | Path, devices: Sequence[str], *, repeats: int = 3, per_device: bool = True,
                  transfers: str = "data-plane", warm_up: bool = True, reporter: Reporter | None = None) -> PhaseCosts:
    """``PhaseCosts`` measured on ``devices`` (the agents of ``link``) for the Llava checkpoint ``model_dir``:
    the studio's *Measure phases on agents* and ``edgeshard epd profile`` alike.

    ``per_device``: every phase timed on every agent (``measurement_rotations``) into
    ``PhaseCosts.devices``; the top-level speeds, the link and the dispatch stay the first
    rotation's. Without it one calibration prices every device (each phase timed on one agent):
    a phase on a slower agent than its own was predicted too fast (docs/gui.md)."""
    from core.models.multimodal import check_multimodal_dir
    from core.techniques.phase_disaggregation.profiling import profile_phases
    from core.techniques.phase_disaggregation.runtime import load_pools

    reporter = reporter or NullReporter()
    check_multimodal_dir(model_dir)
    rotations = measurement_rotations(devices) if per_device else [measurement_pools(devices)]
    timed: list[tuple[PoolConfig, PhaseCosts]] = []
    for i, pools in enumerate(rotations):
        if reporter.cancel_requested():
            raise Cancelled()
        reporter.status(f"loading the phases on {', '.join(pools.devices)} ({i + 1}/{len(rotations)})")
        load_pools(link, model_dir, pools)
        if i == 0:
            link.sync_clocks()
        timed.append((pools, profile_phases(link, model_dir, pools, tiles=PROBE_TILES, prompt_tokens=PROBE_PROMPTS,
                                            decode_batches=PROBE_BATCHES, decode_steps=4, repeats=repeats,
                                            transfers=transfers, time_links=i == 0, warm_up=warm_up,
                                            reporter=reporter)))
        reporter.progress(i + 1, len(rotations))
    pools, costs = timed[0]
    if len(timed) > 1:
        costs = msgspec.structs.replace(costs, devices=tuple(_device_costs(d, timed) for d in dict.fromkeys(devices)))
        where = "every phase timed on every agent"
    else:  # one calibration prices every device: say which agent each phase was timed on
        where = (f"encode timed on {pools.encode[0]}, prefill on {pools.prefill[0]}, decode on {pools.decode[0]}, "
                 "every device priced at their speeds")
    return msgspec.structs.replace(costs, source=f"measured on {', '.join(dict.fromkeys(devices))} "
                                                 f"({Path(model_dir).name}; {where})")


def _device_costs(device: str, timed: Sequence[tuple[PoolConfig, PhaseCosts]]) -> DevicePhaseCosts:
    """``device``'s own speeds: each phase from the rotation that timed it there."""
    def on(phase: str) -> PhaseCosts:
        return next(c for p, c in timed if getattr(p, phase)[0] == device)

    e, p, d = on("encode"), on("prefill"), on("decode")
    return DevicePhaseCosts(device=device, encode_s_per_tile=e.encode_s_per_tile, encode_overhead_s=e.encode_overhead_s,
                            encode_input_s_per_tile=e.encode_input_s_per_tile,
                            prefill_s_per_token=p.prefill_s_per_token, prefill_overhead_s=p.prefill_overhead_s,
                            decode_step_s=d.decode_step_s)


def per_device_text(costs: PhaseCosts) -> str:
    """Each device's phase speeds in one line (the studio's status), or the one calibration's."""
    rows = costs.devices or (costs,)
    return "; ".join(f"{getattr(c, 'device', 'every device')}: encode {c.encode_s_per_tile * 1e3:.1f} ms/tile, "
                     f"prefill {c.prefill_s_per_token * 1e3:.2f} ms/token, decode step "
                     f"{costs.decode_step_seconds(1, getattr(c, 'device', '')) * 1e3:.1f} ms" for c in rows)


def agent_workload(*, requests: int = 6, rate_rps: float = 2.0, seed: int = 0) -> Workload:
    """A Poisson workload a small checkpoint serves for real: one or two images of one or two tiles,
    short prompts and answers (the shipped text holds the prompts)."""
    from core.techniques.phase_disaggregation.workload import poisson_workload

    return poisson_workload(rate_rps=rate_rps, requests=requests, seed=seed, images=(1, 2), tiles_per_image=(1, 2),
                            prompt_tokens=(8, 16), output_tokens=(6, 10))


SLO_SLACK = 2.0
"""The studio's default SLOs: this many times what a request gets alone on one agent."""


def agent_slo(costs: PhaseCosts, workload: Workload, slack: float = SLO_SLACK) -> SLO:
    """SLOs scaled to measured costs: ``slack`` × the 90th-percentile TTFT and TPOT of the
    workload's requests each served alone on one agent (simulated with these costs, dispatch and
    hops included), so a layout meets them unless queueing or contention slows it."""
    from core.techniques.phase_disaggregation.simulator import simulate_pools
    from core.techniques.phase_disaggregation.workload import at_rate

    alone = at_rate(workload, 1e-3)  # ~1000 s apart: no request waits for another
    pools = PoolConfig(disaggregation="aggregated", encode=("a",), prefill=("a",), decode=("a",))
    metrics = simulate_pools(costs, alone, pools).metrics

    def p90(values) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    return SLO(ttft_s=slack * p90(m.ttft_s for m in metrics), tpot_s=slack * max(p90(m.tpot_s for m in metrics), 1e-4))


def cluster_problem(costs: PhaseCosts, devices: Sequence[str], workload: Workload, slo: SLO) -> EpdProblem:
    """The search's problem over exactly these agents (no more devices than are connected)."""
    if not devices:
        raise EpdInputError("no agents to plan for: start the demo cluster or connect agents")
    return EpdProblem(name="measured cluster", costs=costs, workload=workload, slo=slo, devices=tuple(devices))


def served_problem(pools: PoolConfig, devices: Sequence[str]) -> str:
    """Why the real run cannot serve ``pools`` on ``devices`` ("" when it can): what the operator must do."""
    from core.techniques.phase_disaggregation.runtime import check_real_pools

    missing = [d for d in pools.devices if d not in devices]
    if missing:
        return (f"the layout uses {', '.join(missing)}, not among the connected agents: measure and search on "
                "these agents")
    try:
        check_real_pools(pools)
    except EpdInputError as err:
        return str(err)
    return ""


class SloFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What a run (or its prediction) gives the operator: TTFT and TPOT, and the share meeting the SLO."""

    requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    attainment: float

    @classmethod
    def of(cls, metrics: Sequence[RequestMetrics], slo: SLO) -> "SloFigures":
        from core.techniques.phase_disaggregation.goodput import attainment

        ttft = sorted(m.ttft_s for m in metrics)
        return cls(requests=len(metrics), ttft_p50_s=statistics.median(ttft),
                   ttft_p90_s=ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
                   tpot_p50_s=statistics.median(m.tpot_s for m in metrics), attainment=attainment(metrics, slo))


PHASES = ("encode", "prefill", "decode")


def phase_seconds(metrics: Sequence[RequestMetrics]) -> dict[tuple[str, str], float]:
    """The median time of each phase on each device over ``metrics`` (simulated or measured alike):
    encode, one request's encode on its one encoder (split requests left out); prefill, its prefill;
    decode, its seconds per token after the first (queueing for a batch slot and batch-mates included)."""
    spans: dict[tuple[str, str], list[float]] = {}
    for m in metrics:
        if len(m.encode_devices) == 1 and m.encode_end_s > m.encode_start_s:
            spans.setdefault((m.encode_devices[0], "encode"), []).append(m.encode_end_s - m.encode_start_s)
        if m.prefill_device:
            spans.setdefault((m.prefill_device, "prefill"), []).append(m.prefill_end_s - m.prefill_start_s)
        if m.decode_device and m.output_tokens > 1:
            spans.setdefault((m.decode_device, "decode"), []).append(
                (m.decode_end_s - m.pd_transfer_end_s) / (m.output_tokens - 1))
    return {key: statistics.median(v) for key, v in spans.items()}


class PhaseFit(msgspec.Struct, frozen=True, kw_only=True):
    """One phase on one device: what the simulator predicted and what the agents took (medians)."""

    device: str
    phase: str
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """Predicted over measured (1: exact; < 1: predicted too fast)."""
        return self.predicted_s / self.measured_s if self.measured_s > 0 else math.inf


def phase_fit(predicted: Sequence[RequestMetrics], measured: Sequence[RequestMetrics]) -> tuple[PhaseFit, ...]:
    """Per device and phase, predicted beside measured, for the phases both have (device order, then phase)."""
    p, m = phase_seconds(predicted), phase_seconds(measured)
    order = {d: i for i, d in enumerate(dict.fromkeys(d for d, _ in list(m) + list(p)))}
    keys = sorted(set(p) & set(m), key=lambda k: (order[k[0]], PHASES.index(k[1])))
    return tuple(PhaseFit(device=d, phase=ph, predicted_s=p[(d, ph)], measured_s=m[(d, ph)]) for d, ph in keys)


class LayoutRun(msgspec.Struct, frozen=True, kw_only=True):
    """One layout served on the agents: its tokens, metrics and figures, the prediction's, the records."""

    layout: str
    pools: PoolConfig
    tokens: dict[int, tuple[int, ...]]
    texts: dict[int, str]
    """Each request's answer, decoded (what the operator reads)."""
    metrics: tuple[RequestMetrics, ...]
    measured: SloFigures
    predicted: SloFigures | None
    run_id: int | None
    predicted_id: int | None
    fit: tuple[PhaseFit, ...] = ()
    """Each device's phases, predicted (the problem's costs) beside measured (``phase_fit``)."""
    prompts: dict[int, str] = {}
    """Each request's text prompt after its image, decoded: the answer continues it (a cut word's rest)."""


def run_layout(link, model_dir: str | Path, problem: EpdProblem, pools: PoolConfig, *, layout: str = "",
               workspace: str = "", session: str = "epd", reporter: Reporter | None = None) -> LayoutRun:
    """Serve ``problem``'s workload with ``pools`` on the agents, record it (and the simulator's
    prediction for the problem's costs) in ``workspace`` when given, and return both figures."""
    from core.sessions.origin import RecordedOrigin
    from core.sessions.store import SessionStore
    from core.techniques.phase_disaggregation.runtime import prepare_requests, record_epd_run, run_epd
    from core.techniques.phase_disaggregation.simulator import record_simulation, simulate_pools

    reporter = reporter or NullReporter()
    why = served_problem(pools, problem.devices)
    if why:
        raise EpdInputError(why)
    reporter.status("preparing the requests' tiles and prompts")
    prepared = prepare_requests(model_dir, problem.workload)
    reporter.status(f"loading {pools.disaggregation} on {', '.join(pools.devices)}")
    link.sync_clocks()
    reporter.status(f"serving {len(prepared)} requests")
    run = run_epd(link, model_dir, problem.workload, pools, prepared=prepared, reporter=reporter)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    texts = {rid: tokenizer.decode(list(ids), skip_special_tokens=True) for rid, ids in run.tokens.items()}
    from core.models.multimodal import check_multimodal_dir

    image_token = check_multimodal_dir(model_dir).image_token_id
    prompts = {p.id: tokenizer.decode([t for t in p.input_ids if t != image_token], skip_special_tokens=True)
               for p in prepared}
    # each token's text piece in the record, as a layer-sharding run's coordinator fills it: a replay
    # in Sessions shows the answers, not token ids
    run = msgspec.structs.replace(run, token_events=tuple(
        msgspec.structs.replace(t, text=tuple(tokenizer.decode([i], skip_special_tokens=True) for i in t.token_ids)) for t in run.token_events))
    sim = simulate_pools(problem.costs, problem.workload, pools, record=bool(workspace))
    run_id = predicted_id = None
    if workspace:
        model = Path(model_dir).name
        with SessionStore(workspace) as store:
            sid = store.create_session(session)
            run_id = record_epd_run(store, sid, run, model=model, workload=problem.workload, pools=pools,
                                    slo=problem.slo)
            store.set_origin(run_id, RecordedOrigin.of("phase-disaggregation", problem, pools))  # its replay's ghosts
            predicted_id = record_simulation(store, sid, sim, model=model, workload=problem.workload, pools=pools,
                                             slo=problem.slo)
    return LayoutRun(layout=layout or pools.disaggregation, pools=pools, tokens=run.tokens, texts=texts, metrics=run.metrics,
                     measured=SloFigures.of(run.metrics, problem.slo),
                     predicted=SloFigures.of(sim.metrics, problem.slo), run_id=run_id, predicted_id=predicted_id,
                     fit=phase_fit(sim.metrics, run.metrics), prompts=prompts)


__all__ = ["LayoutRun", "PhaseFit", "SloFigures", "agent_slo", "agent_workload", "cluster_problem", "measure_costs",
           "measurement_pools", "measurement_rotations", "per_device_text", "phase_fit", "phase_seconds", "run_layout",
           "served_problem"]
