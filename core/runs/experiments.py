"""The EdgeShard paper's experiments, reproduced in simulation with the project's cost model.

Each experiment returns an ``ExperimentResult``: a table, the figures' data and the paper's
findings, each marked held or not held with the figure it rests on. ``write_outputs`` puts
the table in a CSV and every figure in a PNG and an SVG (matplotlib, Agg: no display).
It lives in the runs wing because the pipeline experiment plays plans out in the simulator.

- ``table-iv``: Table IV, latency (batch 1) and throughput (batch ≤ 8) of Llama2-7B/13B/70B
  for Edge-Solo, Cloud-Edge-Even, Cloud-Edge-Opt and EdgeShard.
- ``bandwidth``: Figs 7–8, 7B as the source–cloud bandwidth goes 1 → 50 Mbit/s.
- ``source``: Fig 9, 7B with an AGX Orin or an Orin NX as the source.
- ``pipelines``: Fig 10, each method's throughput plan played with and without bubbles.
- ``algorithms`` (ours): the paper's Algorithms 1 and 2 against the exact solvers.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import msgspec

from core.errors import EdgeShardError
from core.planning.problem import PlanningProblem
from core.planning.scenarios import PAPER_MODELS, paper_problem
from core.planning.solvers.comparison import StrategyOutcome, run_strategy, shortfall_text, status_text
from core.reporting import Cancelled, NullReporter, Reporter

class UnknownExperiment(EdgeShardError):
    """The operator named an experiment that does not exist."""


METHODS = ("edge-solo", "cloud-edge-even", "cloud-edge-opt", "edgeshard")
LABELS = {"edge-solo": "Edge-Solo", "cloud-edge-even": "Cloud-Edge-Even", "cloud-edge-opt": "Cloud-Edge-Opt",
          "edgeshard": "EdgeShard", "paper-dp-latency": "Algorithm 1", "paper-dp-throughput": "Algorithm 2"}


class Series(msgspec.Struct, frozen=True):
    label: str
    y: tuple[float | None, ...]
    """None where the method has no plan (OOM): a gap in the line, no bar."""


class Figure(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    """File stem: ``fig7-latency`` → fig7-latency.png / .svg."""
    title: str
    x_label: str
    y_label: str
    x: tuple[str, ...]
    series: tuple[Series, ...]
    kind: str = "line"
    """line (numeric x) or bar (categories)."""
    log_y: bool = False
    """A log scale where values span orders of magnitude (70B beside 7B)."""


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    claim: str
    """The paper's finding, with the criterion we test it by."""
    held: bool
    detail: str
    """Our numbers (and the paper's where it gives them)."""
    figure: str = ""


class ExperimentResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    findings: tuple[Finding, ...]
    figures: tuple[Figure, ...]


def _step(reporter: Reporter, text: str, done: int, total: int) -> None:
    """Say what runs next; stop here if the operator cancelled."""
    if reporter.cancel_requested():
        raise Cancelled()
    reporter.status(text)
    reporter.progress(done, total)


def _latency_problem(problem: PlanningProblem) -> PlanningProblem:
    """The paper's latency is per token of one sequence."""
    return msgspec.structs.replace(problem, workload=msgspec.structs.replace(problem.workload, batch_size=1))


def _fits(out: StrategyOutcome) -> bool:
    return out.status in ("ok", "optimal")


def _ms(out: StrategyOutcome) -> float | None:
    return out.latency_s * 1e3 if _fits(out) else None


def _tps(out: StrategyOutcome) -> float | None:
    return out.tokens_per_s if _fits(out) else None


def _fmt(v: float | None, digits: int = 2) -> str:
    return "OOM" if v is None else f"{v:.{digits}f}"


def _run_methods(problem: PlanningProblem, methods, time_limit_s: float) -> dict[tuple[str, str], StrategyOutcome]:
    """(method, objective) → outcome; latency at batch 1, throughput at the problem's batch."""
    lat = _latency_problem(problem)
    out = {}
    for m in methods:
        out[(m, "latency")] = run_strategy(lat, m, "latency", time_limit_s)
        out[(m, "throughput")] = run_strategy(problem, m, "throughput", time_limit_s)
    return out


# --- Table IV --------------------------------------------------------------------------

PAPER_TABLE_IV = {
    # The ratios the paper states (§V-B); the only absolute figures it gives here are EdgeShard 7B's.
    "llama-2-7b": {"edgeshard_ms": 75.88, "edgeshard_tps": 52.45,
                   "latency_x": {"edge-solo": 1.85, "cloud-edge-opt": 1.85, "cloud-edge-even": 3.0},
                   "throughput_x": {"edge-solo": 2.2, "cloud-edge-opt": 2.2, "cloud-edge-even": 7.0}},
    "llama-2-13b": {"latency_lower": {"cloud-edge-even": 0.457, "cloud-edge-opt": 0.288},
                    "throughput_x": {"cloud-edge-even": 2.23, "cloud-edge-opt": 2.2}},
}


def table_iv(reporter: Reporter, time_limit_s: float = 30.0) -> ExperimentResult:
    rows, res = [], {}
    for i, model in enumerate(PAPER_MODELS):
        _step(reporter, f"Table IV: {model}", i, len(PAPER_MODELS))
        res[model] = r = _run_methods(paper_problem(model), METHODS, time_limit_s)
        best_l, best_t = r[("edgeshard", "latency")], r[("edgeshard", "throughput")]
        paper = PAPER_TABLE_IV.get(model, {})
        for m in METHODS:
            lo, to = r[(m, "latency")], r[(m, "throughput")]
            ratio_l = f"{lo.latency_s / best_l.latency_s:.2f}×" if _fits(lo) and _fits(best_l) else "—"
            ratio_t = f"{best_t.tokens_per_s / to.tokens_per_s:.2f}×" if _fits(to) and _fits(best_t) and to.tokens_per_s else "—"
            paper_l = paper.get("latency_x", {}).get(m)
            paper_t = paper.get("throughput_x", {}).get(m)
            if m == "edgeshard" and "edgeshard_ms" in paper:
                paper_l_txt, paper_t_txt = f"{paper['edgeshard_ms']} ms", f"{paper['edgeshard_tps']} tok/s"
            else:
                paper_l_txt = f"{paper_l}×" if paper_l else (f"−{paper['latency_lower'][m] * 100:.1f} %" if m in paper.get("latency_lower", {}) else "")
                paper_t_txt = f"{paper_t}×" if paper_t else ""
            mk = f"{to.cost.micro_batch_size}×{to.cost.micro_batches}" if _fits(to) else "—"
            rows.append((model, LABELS[m], _fmt(_ms(lo)), ratio_l, paper_l_txt, _fmt(_tps(to)), mk, ratio_t, paper_t_txt,
                         "; ".join(dict.fromkeys(s for s in (_short_status(lo), _short_status(to)) if s))))
    reporter.progress(len(PAPER_MODELS), len(PAPER_MODELS))
    figures = (
        Figure(name="table-iv-latency", title="Table IV: latency per token (batch 1)", x_label="model",
               y_label="ms/token (log)", x=PAPER_MODELS, kind="bar", log_y=True,
               series=tuple(Series(LABELS[m], tuple(_ms(res[mo][(m, "latency")]) for mo in PAPER_MODELS)) for m in METHODS)),
        Figure(name="table-iv-throughput", title="Table IV: throughput (batch ≤ 8)", x_label="model",
               y_label="tokens/s (log)", x=PAPER_MODELS, kind="bar", log_y=True,
               series=tuple(Series(LABELS[m], tuple(_tps(res[mo][(m, "throughput")]) for mo in PAPER_MODELS)) for m in METHODS)),
    )
    return ExperimentResult(
        name="table-iv", title="Table IV: latency and throughput of Llama2 on the paper's testbed",
        columns=("model", "method", "latency ms", "÷ EdgeShard", "paper", "tokens/s", "m×K", "EdgeShard ×", "paper", "status"),
        rows=tuple(rows), findings=tuple(_table_iv_findings(res)), figures=figures)


def _short_status(out: StrategyOutcome) -> str:
    return "" if out.status in ("ok", "optimal") else status_text(out)


def _table_iv_findings(res) -> list[Finding]:
    out = []
    r7 = res["llama-2-7b"]
    es_l, es_t = r7[("edgeshard", "latency")], r7[("edgeshard", "throughput")]
    solo_l, solo_t = r7[("edge-solo", "latency")], r7[("edge-solo", "throughput")]
    x_l = solo_l.latency_s / es_l.latency_s
    x_t = es_t.tokens_per_s / solo_t.tokens_per_s
    out.append(Finding(claim="7B: EdgeShard's latency ≥ 1.4× lower than Edge-Solo's (paper: 1.85×)", held=x_l >= 1.4,
                       detail=f"{solo_l.latency_s * 1e3:.1f} / {es_l.latency_s * 1e3:.1f} ms = {x_l:.2f}×", figure="table-iv-latency"))
    out.append(Finding(claim="7B: EdgeShard's throughput ≥ 1.6× Edge-Solo's (paper: 2.2×)", held=x_t >= 1.6,
                       detail=f"{es_t.tokens_per_s:.1f} / {solo_t.tokens_per_s:.1f} tokens/s = {x_t:.2f}×", figure="table-iv-throughput"))
    opt_l, opt_t = r7[("cloud-edge-opt", "latency")], r7[("cloud-edge-opt", "throughput")]
    same = (opt_l.plan.devices() == solo_l.plan.devices() and opt_t.plan.devices() == solo_t.plan.devices()
            and abs(opt_l.latency_s - solo_l.latency_s) < 1e-9)
    out.append(Finding(claim="7B: Cloud-Edge-Opt = Edge-Solo at 1 Mbit/s (the slow link makes the server useless to it)",
                       held=same, detail=f"Cloud-Edge-Opt plan {'+'.join(opt_l.plan.devices())}, "
                       f"{opt_l.latency_s * 1e3:.1f} vs {solo_l.latency_s * 1e3:.1f} ms", figure="table-iv-latency"))
    even_l, even_t = r7[("cloud-edge-even", "latency")], r7[("cloud-edge-even", "throughput")]
    xe_l, xe_t = even_l.latency_s / es_l.latency_s, es_t.tokens_per_s / even_t.tokens_per_s
    out.append(Finding(claim="7B: EdgeShard ≥ 2× better than Cloud-Edge-Even in latency and ≥ 4× in throughput (paper: ~3×, ~7×)",
                       held=xe_l >= 2 and xe_t >= 4, detail=f"latency {xe_l:.2f}×, throughput {xe_t:.2f}×", figure="table-iv-latency"))
    r13 = res["llama-2-13b"]
    es13_l, es13_t = r13[("edgeshard", "latency")], r13[("edgeshard", "throughput")]
    parts, held = [], True
    for m, paper_lower, paper_x in (("cloud-edge-even", 45.7, 2.23), ("cloud-edge-opt", 28.8, 2.2)):
        lo, to = r13[(m, "latency")], r13[(m, "throughput")]
        if not (_fits(lo) and _fits(to)):
            held = False
            parts.append(f"{LABELS[m]}: {status_text(lo)} (paper: it fits; −{paper_lower} %, {paper_x}×)")
            continue
        lower = 1 - es13_l.latency_s / lo.latency_s
        x = es13_t.tokens_per_s / to.tokens_per_s
        held &= lower > 0 and x >= 1.5
        parts.append(f"{LABELS[m]}: −{lower * 100:.1f} % latency (paper −{paper_lower} %), {x:.2f}× throughput (paper {paper_x}×)")
    out.append(Finding(claim="13B: EdgeShard lower latency and ≥ 1.5× throughput than both cloud-edge methods",
                       held=held, detail="; ".join(parts), figure="table-iv-latency"))
    r70 = res["llama-2-70b"]
    fits = [m for m in METHODS if _fits(r70[(m, "latency")])]
    out.append(Finding(claim="70B: only EdgeShard fits", held=fits == ["edgeshard"],
                       detail=f"fits: {', '.join(LABELS[m] for m in fits) or 'none'}; EdgeShard "
                              f"{_fmt(_ms(r70[('edgeshard', 'latency')]), 1)} ms, {_fmt(_tps(r70[('edgeshard', 'throughput')]))} tokens/s",
                       figure="table-iv-latency"))
    return out


# --- Figs 7–8: source–cloud bandwidth ---------------------------------------------------

BANDWIDTHS = (1, 2, 5, 10, 20, 30, 40, 50)


def bandwidth(reporter: Reporter, time_limit_s: float = 30.0, model: str = "llama-2-7b") -> ExperimentResult:
    res = {}
    for i, bw in enumerate(BANDWIDTHS):
        _step(reporter, f"Figs 7–8: {bw} Mbit/s", i, len(BANDWIDTHS))
        res[bw] = _run_methods(paper_problem(model, server_mbit_s=bw), METHODS, time_limit_s)
    reporter.progress(len(BANDWIDTHS), len(BANDWIDTHS))
    lat = {m: [_ms(res[bw][(m, "latency")]) for bw in BANDWIDTHS] for m in METHODS}
    tps = {m: [_tps(res[bw][(m, "throughput")]) for bw in BANDWIDTHS] for m in METHODS}
    rows = tuple((str(bw), LABELS[m], _fmt(lat[m][i]), _fmt(tps[m][i])) for i, bw in enumerate(BANDWIDTHS) for m in METHODS)
    x = tuple(str(b) for b in BANDWIDTHS)
    figures = (
        Figure(name="fig7-latency", title=f"Fig. 7: {model} latency vs source–cloud bandwidth", x_label="Mbit/s",
               y_label="ms/token", x=x, series=tuple(Series(LABELS[m], tuple(lat[m])) for m in METHODS)),
        Figure(name="fig8-throughput", title=f"Fig. 8: {model} throughput vs source–cloud bandwidth", x_label="Mbit/s",
               y_label="tokens/s", x=x, series=tuple(Series(LABELS[m], tuple(tps[m])) for m in METHODS)),
    )
    return ExperimentResult(name="bandwidth", title=f"Figs 7–8: {model} as the source–cloud link goes 1 → 50 Mbit/s",
                            columns=("Mbit/s", "method", "latency ms", "tokens/s"), rows=rows,
                            findings=tuple(_bandwidth_findings(lat, tps)), figures=figures)


def _bandwidth_findings(lat, tps) -> list[Finding]:
    i1, i10, i50 = BANDWIDTHS.index(1), BANDWIDTHS.index(10), BANDWIDTHS.index(50)
    out = []
    for name, data, fig, better in (("latency", lat, "fig7-latency", min), ("throughput", tps, "fig8-throughput", max)):
        solo = [v for v in data["edge-solo"] if v is not None]
        flat = bool(solo) and max(solo) - min(solo) <= 1e-6 * max(solo)
        out.append(Finding(claim=f"{name}: Edge-Solo is flat", held=flat,
                           detail=f"{min(solo):.2f} … {max(solo):.2f}", figure=fig))
        for m in ("cloud-edge-even", "cloud-edge-opt", "edgeshard"):
            v = data[m]
            claim = f"{name}: {LABELS[m]} changes ≥ 2× more from 1 to 10 Mbit/s than from 10 to 50 (steep, then little)"
            if None in (v[i1], v[i10], v[i50]):
                out.append(Finding(claim=claim, held=False, detail="no plan at some bandwidth", figure=fig))
                continue
            steep, after = abs(v[i10] - v[i1]), abs(v[i50] - v[i10])
            out.append(Finding(claim=claim, held=steep >= 2 * after,
                               detail=f"{v[i1]:.1f} → {v[i10]:.1f} → {v[i50]:.1f} (1 → 10 → 50 Mbit/s)", figure=fig))
        solo_v = data["edge-solo"][0]
        beats = all(v is not None and (v < solo_v if better is min else v > solo_v)
                    for m in ("cloud-edge-even", "cloud-edge-opt") for bw, v in zip(BANDWIDTHS, data[m]) if bw > 10)
        out.append(Finding(claim=f"{name}: above 10 Mbit/s both cloud-edge methods beat Edge-Solo", held=beats,
                           detail=", ".join(f"{LABELS[m]} at 20 Mbit/s {data[m][BANDWIDTHS.index(20)]:.1f}"
                                            for m in ("cloud-edge-even", "cloud-edge-opt")) + f" vs Edge-Solo {solo_v:.1f}", figure=fig))
        even1 = data["cloud-edge-even"][i1]
        worse = even1 is not None and (even1 > solo_v if better is min else even1 < solo_v)
        out.append(Finding(claim=f"{name}: at 1 Mbit/s Cloud-Edge-Even is worse than Edge-Solo", held=worse,
                           detail=f"{_fmt(even1, 1)} vs {solo_v:.1f}", figure=fig))
        never = all(e is not None and o is not None and (e <= o * (1 + 1e-9) if better is min else e >= o * (1 - 1e-9))
                    for e, o in zip(data["edgeshard"], data["cloud-edge-opt"]) if o is not None)
        out.append(Finding(claim=f"{name}: EdgeShard is never worse than Cloud-Edge-Opt", held=never,
                           detail=" ".join(f"{b}:{_fmt(e, 1)}/{_fmt(o, 1)}" for b, e, o in
                                           zip(BANDWIDTHS, data["edgeshard"], data["cloud-edge-opt"])), figure=fig))
    return out


# --- Fig 9: the source device -----------------------------------------------------------

SOURCES = ("agx-00", "nx-00")


def source(reporter: Reporter, time_limit_s: float = 30.0, model: str = "llama-2-7b") -> ExperimentResult:
    res = {}
    for i, src in enumerate(SOURCES):
        _step(reporter, f"Fig. 9: source {src}", i, len(SOURCES))
        res[src] = _run_methods(paper_problem(model, source=src), METHODS, time_limit_s)
    reporter.progress(len(SOURCES), len(SOURCES))
    rows = tuple((src, LABELS[m], _fmt(_ms(res[src][(m, "latency")])), _fmt(_tps(res[src][(m, "throughput")])),
                  _short_status(res[src][(m, "latency")])) for src in SOURCES for m in METHODS)
    figures = (Figure(name="fig9-source", title=f"Fig. 9: {model} latency with an AGX Orin or an Orin NX as the source",
                      x_label="method", y_label="ms/token", x=tuple(LABELS[m] for m in METHODS), kind="bar",
                      series=tuple(Series("AGX Orin source" if s == "agx-00" else "Orin NX source",
                                          tuple(_ms(res[s][(m, "latency")]) for m in METHODS)) for s in SOURCES)),)
    nx, agx = res["nx-00"], res["agx-00"]
    oom = [m for m in ("edge-solo", "cloud-edge-even") if not _fits(nx[(m, "latency")])]
    gap = {m: (_ms(nx[(m, "latency")]) or 0) - (_ms(agx[(m, "latency")]) or 0) for m in ("edgeshard", "cloud-edge-opt")}
    findings = (
        Finding(claim="NX source: Edge-Solo and Cloud-Edge-Even run out of memory", held=len(oom) == 2,
                detail="; ".join(f"{LABELS[m]}: {status_text(nx[(m, 'latency')])}" for m in ("edge-solo", "cloud-edge-even")),
                figure="fig9-source"),
        Finding(
            claim="EdgeShard's AGX→NX latency gap is small (paper ~5 ms) where Cloud-Edge-Opt's is large (paper ~60 ms): "
                  "EdgeShard's gap < ¼ of Cloud-Edge-Opt's",
            held=gap["edgeshard"] < 0.25 * gap["cloud-edge-opt"],
            detail=f"EdgeShard +{gap['edgeshard']:.1f} ms, Cloud-Edge-Opt +{gap['cloud-edge-opt']:.1f} ms", figure="fig9-source"),
    )
    return ExperimentResult(name="source", title=f"Fig. 9: {model} with the prompt on an AGX Orin or an Orin NX",
                            columns=("source", "method", "latency ms", "tokens/s", "status"), rows=rows,
                            findings=findings, figures=figures)


# --- Fig 10: pipelines with and without bubbles ----------------------------------------

PIPELINE_MODELS = ("llama-2-7b", "llama-2-13b")


def pipelines(reporter: Reporter, time_limit_s: float = 30.0) -> ExperimentResult:
    from core.runs.simulator import simulate

    rows, data = [], {}
    total = len(PIPELINE_MODELS) * len(METHODS)
    for i, model in enumerate(PIPELINE_MODELS):
        problem = paper_problem(model)
        for j, m in enumerate(METHODS):
            _step(reporter, f"Fig. 10: {model} {LABELS[m]}", i * len(METHODS) + j, total)
            out = run_strategy(problem, m, "throughput", time_limit_s)
            if not _fits(out):
                data[(model, m)] = (None, None, out)
                rows.append((model, LABELS[m], "—", "OOM", "OOM", "", _short_status(out)))
                continue
            tput = {mode: simulate(problem, out.plan, mode).figures.decode_tokens_per_s for mode in ("bubbles", "no-bubbles")}
            data[(model, m)] = (tput["bubbles"], tput["no-bubbles"], out)
            gain = tput["no-bubbles"] / tput["bubbles"] - 1
            rows.append((model, LABELS[m], f"{out.plan.micro_batch_size}×{out.plan.micro_batches} on {len(out.plan.stages)} stages",
                         f"{tput['bubbles']:.2f}", f"{tput['no-bubbles']:.2f}", f"+{gain * 100:.1f} %", ""))
    reporter.progress(total, total)
    figures = tuple(
        Figure(name=f"fig10-{model}", title=f"Fig. 10: {model} decode throughput, bubbles vs no bubbles", x_label="method",
               y_label="tokens/s", x=tuple(LABELS[m] for m in METHODS), kind="bar",
               series=(Series("bubbles", tuple(data[(model, m)][0] for m in METHODS)),
                       Series("no bubbles", tuple(data[(model, m)][1] for m in METHODS))))
        for model in PIPELINE_MODELS)
    pipelined = [(k, v) for k, v in data.items() if v[0] is not None and len(v[2].plan.stages) > 1 and v[2].plan.micro_batches > 1]
    held = bool(pipelined) and all(nb > b for _, (b, nb, _o) in pipelined)
    never_worse = all(nb >= b * (1 - 1e-9) for (b, nb, _o) in data.values() if b is not None)
    findings = (
        Finding(claim="no-bubbles beats bubbles for every method whose plan is a pipeline (≥ 2 stages, ≥ 2 micro-batches), "
                      "and is never worse", held=held and never_worse,
                detail="; ".join(f"{mo} {LABELS[m]} +{(nb / b - 1) * 100:.1f} %" for (mo, m), (b, nb, _o) in pipelined)
                       + (" — single-stage or one-micro-batch plans are equal by construction" if len(pipelined) < len(data) else ""),
                figure="fig10-llama-2-7b"),
    )
    return ExperimentResult(name="pipelines", title="Fig. 10: the no-bubbles schedule against the bubbles one (simulated, 96 tokens)",
                            columns=("model", "method", "plan", "bubbles tok/s", "no-bubbles tok/s", "gain", "status"),
                            rows=tuple(rows), findings=findings, figures=figures)


# --- ours: the paper's algorithms against the exact solvers ----------------------------

def algorithms(reporter: Reporter, time_limit_s: float = 30.0) -> ExperimentResult:
    rows, findings, fig_lat, fig_tps = [], [], {}, {}
    for i, model in enumerate(PAPER_MODELS):
        _step(reporter, f"Algorithms 1 and 2: {model}", i, len(PAPER_MODELS))
        problem = paper_problem(model)
        lat_problem = _latency_problem(problem)
        exact_l = run_strategy(lat_problem, "edgeshard", "latency", time_limit_s)
        exact_t = run_strategy(problem, "edgeshard", "throughput", time_limit_s)
        a1 = run_strategy(lat_problem, "paper-dp-latency", "latency", time_limit_s)
        a2 = run_strategy(problem, "paper-dp-throughput", "throughput", time_limit_s)
        fig_lat[model] = (_ms(exact_l), _ms(a1))
        fig_tps[model] = (_tps(exact_t), _tps(a2))
        for label, out, ref in (("exact latency", exact_l, None), ("Algorithm 1", a1, exact_l),
                                ("exact throughput", exact_t, None), ("Algorithm 2", a2, exact_t)):
            value = _fmt(_ms(out), 1) + " ms" if out.objective == "latency" else _fmt(_tps(out)) + " tok/s"
            if out.status in ("oom", "invalid", "failed"):
                value = "—"
            rows.append((model, label, value, status_text(out) if ref is None or not _fits(out) else shortfall_text(out, ref) or "ok"))
        for label, out, ref in (("Algorithm 1", a1, exact_l), ("Algorithm 2", a2, exact_t)):
            findings.append(Finding(claim=f"{model}: {label} returns a valid optimal plan", held=_fits(out) and
                                    shortfall_text(out, ref) == "= the optimum",
                                    detail=status_text(out) if not _fits(out) else shortfall_text(out, ref) or status_text(out),
                                    figure="algorithms-latency" if label == "Algorithm 1" else "algorithms-throughput"))
    reporter.progress(len(PAPER_MODELS), len(PAPER_MODELS))
    figures = (
        Figure(name="algorithms-latency", title="Algorithm 1 vs the exact latency optimum (batch 1)", x_label="model",
               y_label="ms/token", x=PAPER_MODELS, kind="bar",
               series=(Series("exact", tuple(fig_lat[m][0] for m in PAPER_MODELS)),
                       Series("Algorithm 1", tuple(fig_lat[m][1] for m in PAPER_MODELS)))),
        Figure(name="algorithms-throughput", title="Algorithm 2 vs the exact throughput optimum (batch ≤ 8)", x_label="model",
               y_label="tokens/s", x=PAPER_MODELS, kind="bar",
               series=(Series("exact", tuple(fig_tps[m][0] for m in PAPER_MODELS)),
                       Series("Algorithm 2", tuple(fig_tps[m][1] for m in PAPER_MODELS)))),
    )
    return ExperimentResult(name="algorithms", title="The paper's Algorithms 1 and 2 against the exact solvers",
                            columns=("model", "solver", "value", "status"), rows=tuple(rows),
                            findings=tuple(findings), figures=figures)


# --- the paper's setup in miniature, measured --------------------------------------------

def miniature(reporter: Reporter, time_limit_s: float = 20.0, setup=None) -> ExperimentResult:
    """Edge-Solo, Cloud-Edge-Even, Cloud-Edge-Opt and EdgeShard run for real on a netns testbed
    shaped like the paper's (``core.runs.miniature``), each beside its prediction. Needs root."""
    from core.runs.miniature import MiniatureSetup, measure_miniature

    setup = setup or MiniatureSetup(time_limit_s=min(time_limit_s, 60.0))
    return miniature_result(measure_miniature(setup, reporter))


def _err(measured: float | None, predicted: float | None) -> str:
    return "—" if not measured or predicted is None else f"{(predicted / measured - 1) * 100:+.0f} %"


def miniature_result(m) -> ExperimentResult:
    """The table, findings and figures of a ``core.runs.miniature.MiniatureMeasurement``."""
    s = m.setup
    rows = tuple(
        (LABELS[r.method], r.stages, _fmt(r.measured_ms), _fmt(r.predicted_ms), _err(r.measured_ms, r.predicted_ms),
         r.mk or "—", _fmt(r.measured_tps), _fmt(r.predicted_tps), _err(r.measured_tps, r.predicted_tps),
         "yes" if r.tokens_equal_edge_solo else "NO", r.status)
        for r in m.rows)
    solo, es = m.row("edge-solo"), m.row("edgeshard")
    even, opt = m.row("cloud-edge-even"), m.row("cloud-edge-opt")
    findings = []

    def both(*vals) -> bool:
        return all(v is not None for v in vals)

    if both(solo.measured_ms, es.measured_ms):
        findings.append(Finding(
            claim="measured: EdgeShard's latency ≤ Edge-Solo's (paper: 1.85× lower)",
            held=es.measured_ms <= solo.measured_ms,
            detail=f"{solo.measured_ms:.1f} / {es.measured_ms:.1f} ms = {solo.measured_ms / es.measured_ms:.2f}× "
                   f"(predicted {solo.predicted_ms / es.predicted_ms:.2f}×)", figure="miniature-latency"))
    if both(solo.measured_tps, es.measured_tps):
        findings.append(Finding(
            claim="measured: EdgeShard's throughput ≥ Edge-Solo's (paper: 2.2×)",
            held=es.measured_tps >= solo.measured_tps,
            detail=f"{es.measured_tps:.1f} / {solo.measured_tps:.1f} tokens/s = {es.measured_tps / solo.measured_tps:.2f}× "
                   f"(predicted {es.predicted_tps / solo.predicted_tps:.2f}×)", figure="miniature-throughput"))
    if both(solo.measured_ms, even.measured_ms):
        findings.append(Finding(
            claim="measured: over the slow source–cloud link Cloud-Edge-Even is worse than Edge-Solo (paper: at 1 Mbit/s)",
            held=even.measured_ms > solo.measured_ms,
            detail=f"{even.measured_ms:.1f} vs {solo.measured_ms:.1f} ms/token", figure="miniature-latency"))
    findings.append(Finding(
        claim="Cloud-Edge-Opt = Edge-Solo over the slow link (the same plan)",
        held=opt.stages == solo.stages, detail=f"Cloud-Edge-Opt {opt.stages}; Edge-Solo {solo.stages}"
        + (f"; measured {opt.measured_ms:.1f} vs {solo.measured_ms:.1f} ms" if both(opt.measured_ms, solo.measured_ms) else "")))
    measured = [r for r in m.rows if both(r.measured_ms, r.predicted_ms)]
    by_measured = [r.method for r in sorted(measured, key=lambda r: r.measured_ms)]
    by_predicted = [r.method for r in sorted(measured, key=lambda r: r.predicted_ms)]
    findings.append(Finding(
        claim="the measured latency ordering is the predicted one",
        held=by_measured == by_predicted,
        detail="measured " + " < ".join(LABELS[x] for x in by_measured)
               + "; predicted " + " < ".join(LABELS[x] for x in by_predicted)))
    findings.append(Finding(
        claim="every method computes the same tokens as Edge-Solo (latency runs, greedy)",
        held=all(r.tokens_equal_edge_solo for r in m.rows),
        detail=", ".join(f"{LABELS[r.method]}: {'equal' if r.tokens_equal_edge_solo else 'DIFFERENT'}" for r in m.rows)))
    labels = tuple(LABELS[r.method] for r in m.rows)
    figures = (
        Figure(name="miniature-latency", title="Miniature testbed: latency per token, measured vs predicted",
               x_label="method", y_label="ms/token", x=labels, kind="bar",
               series=(Series("measured", tuple(r.measured_ms for r in m.rows)),
                       Series("predicted", tuple(r.predicted_ms for r in m.rows)))),
        Figure(name="miniature-throughput", title="Miniature testbed: throughput (no-bubbles), measured vs predicted",
               x_label="method", y_label="tokens/s", x=labels, kind="bar",
               series=(Series("measured", tuple(r.measured_tps for r in m.rows)),
                       Series("predicted", tuple(r.predicted_tps for r in m.rows)))),
    )
    title = (f"The paper's setup in miniature, measured: Llama {s.layers} layers × {s.hidden} (fp32) on "
             f"{s.edges} edges ({s.edge_slowdown:g}× slower) + 1 cloud; source–cloud {s.slow_link_mbit:g} Mbit/s, "
             f"others {s.edge_link_mbit:g} Mbit/s ±{s.edge_link_spread * 100:.0f} %; load {m.load[0]:.1f} → {m.load[1]:.1f}")
    return ExperimentResult(
        name="miniature", title=title,
        columns=("method", "latency plan", "measured ms", "predicted ms", "error", "m×K", "measured tok/s",
                 "predicted tok/s", "error", "tokens = Edge-Solo", "status"),
        rows=rows, findings=tuple(findings), figures=figures)


EXPERIMENTS: dict[str, Callable[..., ExperimentResult]] = {
    "table-iv": table_iv,
    "bandwidth": bandwidth,
    "source": source,
    "pipelines": pipelines,
    "algorithms": algorithms,
    "miniature": miniature,
}


def run_experiment(name: str, reporter: Reporter | None = None, time_limit_s: float = 30.0) -> ExperimentResult:
    """Run one of ``EXPERIMENTS``; an unknown name raises ``UnknownExperiment`` listing the known ones."""
    if name not in EXPERIMENTS:
        raise UnknownExperiment(f"no experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name](reporter or NullReporter(), time_limit_s)


# --- output ----------------------------------------------------------------------------

def format_result(result: ExperimentResult) -> str:
    """The table and the findings as text (what ``edgeshard experiment`` prints)."""
    rows = [result.columns, *result.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(result.columns))]
    lines = [result.title, ""]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += ["", "findings:"]
    for f in result.findings:
        lines.append(f"  [{'held' if f.held else 'NOT HELD'}] {f.claim}")
        lines.append(f"      {f.detail}" + (f"  (figure: {f.figure})" if f.figure else ""))
    return "\n".join(lines)


def write_outputs(result: ExperimentResult, out_dir: str | Path) -> list[Path]:
    """``<name>.csv`` (the table), ``<name>-findings.csv`` and a PNG + SVG per figure, in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    table = out / f"{result.name}.csv"
    with table.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(result.columns)
        w.writerows(result.rows)
    findings = out / f"{result.name}-findings.csv"
    with findings.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(("claim", "held", "detail", "figure"))
        w.writerows((f.claim, "held" if f.held else "not held", f.detail, f.figure) for f in result.findings)
    written += [table, findings]
    for fig in result.figures:
        written += draw_figure(fig, out)
    return written


def draw_figure(fig: Figure, out_dir: Path) -> list[Path]:
    """One figure as PNG and SVG (matplotlib's Agg canvas: no display, no Qt)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    mfig = MplFigure(figsize=(7.5, 4.5), dpi=110)
    FigureCanvasAgg(mfig)
    ax = mfig.add_subplot(1, 1, 1)
    n = len(fig.series)
    if fig.kind == "bar":
        width = 0.8 / max(n, 1)
        for i, s in enumerate(fig.series):
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(fig.x))]
            ys = [v if v is not None else float("nan") for v in s.y]
            bars = ax.bar(xs, ys, width=width, label=s.label)
            for b, v in zip(bars, s.y):
                if v is None:  # no bar: say why at the foot of the axis
                    ax.annotate("OOM", (b.get_x() + b.get_width() / 2, 0.01), xycoords=("data", "axes fraction"),
                                ha="center", va="bottom", fontsize=7, rotation=90)
                else:
                    ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(fig.x)), fig.x)
    else:
        xs = [float(x) for x in fig.x]
        for s in fig.series:
            ax.plot(xs, [float("nan") if v is None else v for v in s.y], marker="o", label=s.label)
    if fig.log_y:
        ax.set_yscale("log")
    ax.set_title(fig.title, fontsize=10)
    ax.set_xlabel(fig.x_label)
    ax.set_ylabel(fig.y_label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    mfig.tight_layout()
    paths = [out_dir / f"{fig.name}.png", out_dir / f"{fig.name}.svg"]
    for p in paths:
        mfig.savefig(p)
    return paths
