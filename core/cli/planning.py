"""`edgeshard plan` and `edgeshard compare` (registered through the edgeshard.commands entry point).

Both read a problem file, a scenario file (several problems) or a measured profile
(made plannable with --source / --prompt-tokens / --generated-tokens / --batch).
Human output is a table; ``--json`` prints one JSON document (docs/formats.md).
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from core.arguments import float_in, int_in
from core.errors import EdgeShardError, FormatError
from core.formats import format_of, load, save
from core.planning.precision import allowed_precisions
from core.planning.problem import PROBLEM_FORMAT, PlanningProblem, Workload, check_problem, without_offline
from core.devices.profile import PROFILE_FORMAT, Profile, profile_errors
from core.planning.scenarios import SCENARIO_FORMAT, Scenario
from core.planning.solvers import PAPER_STRATEGIES, STRATEGIES
from core.planning.solvers.comparison import FP_ONLY, StrategyOutcome, run_strategy, shortfall_text, status_text
from core.techniques import StrategyOutcomeLike, technique_named, techniques

GIB = 2**30
PLAN_RESULT_FORMAT = "edgeshard.plan-result"
COMPARISON_FORMAT = "edgeshard.comparison"


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""
    p = sub.add_parser("plan", help="shard a model over devices (exact optimum or a baseline)",
                       description="Plan how a model is split over devices.")
    _input_args(p)
    p.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    p.add_argument("--strategy", choices=sorted((*STRATEGIES, FP_ONLY)), default="edgeshard",
                   help="edgeshard = the exact optimum (default; with --quality-bound it chooses each device's "
                        "weight precision too, edgeshard-fp keeps every stage at fp); paper-dp-latency / "
                        "paper-dp-throughput = the paper's Algorithms 1 and 2 as published; the others are baselines")
    p.add_argument("--devices", metavar="A,B,...", help="for even / memory-proportional: the devices, in stage order")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan (edgeshard.plan format)")
    p.add_argument("--agents", metavar="AGENTS.json",
                   help="the cluster's agents (from `cluster local` or deploy): devices whose agent is not "
                        "running (its port refuses) or whose host does not answer within 3 s are offline and "
                        "left out of the plan, each named with why")
    p.add_argument("--json", action="store_true", help="print the result as JSON (edgeshard.plan-result)")
    p.set_defaults(func=cmd_plan)

    c = sub.add_parser("compare", help="every strategy side by side (latency, throughput, memory, OOM)",
                       description="Compare EdgeShard's optimum with the baselines.")
    _input_args(c)
    c.add_argument("--objective", choices=("latency", "throughput", "both"), default="both")
    c.add_argument("--technique", default="layer-sharding", metavar="NAME",
                   help="whose strategies to compare (edgeshard techniques lists them; default layer-sharding)")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON (edgeshard.comparison)")
    c.add_argument("--draft", metavar="DIR", help="also plain vs speculative decoding with this draft checkpoint "
                   "(its stored acceptance rate): one sequence's predicted tokens/s per plan, at the chosen k")
    c.set_defaults(func=cmd_compare)

    t = sub.add_parser("techniques", help="the placement techniques this studio offers",
                       description="List the techniques: their strategies, stage kinds and run modes.")
    t.set_defaults(func=cmd_techniques)

    from core.cli import experiments

    experiments.register(sub)  # the paper's experiments: no entry point of their own


def _input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="PROBLEM.json", help="a problem, scenario or profile file")
    p.add_argument("--problem", metavar="NAME", help="in a scenario: the problem's index, name or model name")
    p.add_argument("--time-limit", type=float_in(0, 86_400, lo_open=True), default=30.0, metavar="S", help="exact search budget (default 30 s)")
    p.add_argument("--quality-bound", type=float_in(0, 10), metavar="F",
                   help="let the exact solver give devices int8/int4 weights whose measured perplexity is at most F "
                        "above fp's (0.05 = 5 %%; the profile's weight_quality, from `edgeshard measure-precision`)")
    g = p.add_argument_group("for a profile file")
    g.add_argument("--source", help="device holding the prompt (default: the profile's first device)")
    g.add_argument("--prompt-tokens", type=int_in(1, 1 << 20), help="default: the profiled prompt length, else 128")
    g.add_argument("--generated-tokens", type=int_in(1, 1 << 20), default=128)
    g.add_argument("--batch", type=int_in(1, 1 << 16), default=1, help="sequences served together")


def load_problems(args: argparse.Namespace) -> list[PlanningProblem]:
    """The problems a file holds (a problem, a scenario's problems, or a profile made into one)."""
    path = args.file
    fmt = format_of(path)
    if fmt == PROBLEM_FORMAT:
        problems = [load(path, PlanningProblem)]
    elif fmt == SCENARIO_FORMAT:
        problems = list(load(path, Scenario).problems)
    elif fmt == PROFILE_FORMAT:
        profile = load(path, Profile)
        errors = profile_errors(profile)
        if errors:
            field, _, msg = errors[0].partition(": ")
            raise FormatError(path, msg, field)
        problems = [_problem_from_profile(profile, args, path)]
    else:
        raise FormatError(path, f"this is a {fmt!r} file; expected a problem, scenario or profile", "$.format")
    if getattr(args, "problem", None):
        problems = [_pick(problems, args.problem, path)]
    if getattr(args, "quality_bound", None) is not None:
        problems = [msgspec.structs.replace(p, max_perplexity_increase=args.quality_bound) for p in problems]
    for p in problems:
        check_problem(p, path)
    return problems


def _problem_from_profile(profile: Profile, args: argparse.Namespace, path: str) -> PlanningProblem:
    ids = profile.cluster.device_ids()
    source = args.source or (ids[0] if ids else "")
    if source not in ids:
        raise FormatError(path, f"--source {source!r} is not a device of this profile ({', '.join(ids)})")
    prompt = args.prompt_tokens or (profile.profiled_workload.prompt_tokens if profile.profiled_workload else 128)
    for name, v in (("--prompt-tokens", prompt), ("--generated-tokens", args.generated_tokens), ("--batch", args.batch)):
        if v < 1:
            raise EdgeShardError(f"{name} must be at least 1, got {v}")
    return PlanningProblem(
        name=f"{profile.model.name} ({path})", profile=profile, source=source,
        workload=Workload(prompt_tokens=prompt, generated_tokens=args.generated_tokens, batch_size=args.batch),
    )


def _pick(problems: list[PlanningProblem], key: str, path: str) -> PlanningProblem:
    if key.isdigit() and int(key) < len(problems):
        return problems[int(key)]
    for p in problems:
        if key in (p.name, p.profile.model.name):
            return p
    names = ", ".join(f"{i}: {p.profile.model.name}" for i, p in enumerate(problems))
    raise EdgeShardError(f"{path}: no problem {key!r}; it holds {names}")


# --- plan ------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    problems = load_problems(args)
    if len(problems) > 1:
        names = ", ".join(f"{i}: {p.profile.model.name}" for i, p in enumerate(problems))
        raise EdgeShardError(f"{args.file} holds {len(problems)} problems; choose one with --problem ({names})")
    problem = problems[0]
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    if devices is not None and args.strategy not in ("even", "memory-proportional"):
        raise EdgeShardError("--devices applies to the even and memory-proportional strategies only")
    offline_why = _offline_devices(args.agents, problem) if args.agents else {}
    offline = tuple(offline_why)
    if offline:
        problem = without_offline(problem, offline)
        if devices is not None and set(devices) & set(offline):
            raise EdgeShardError(f"--devices names offline device(s): {', '.join(sorted(set(devices) & set(offline)))}")
    out = run_strategy(problem, args.strategy, args.objective, args.time_limit, devices=devices)
    if out.status == "failed":
        raise EdgeShardError(out.error)
    if args.out:
        save(args.out, out.plan)
    if args.json:
        doc = {"format": PLAN_RESULT_FORMAT, "version": 1, "problem": problem.name, **_outcome_doc(out),
               **({"offline": list(offline), "offline_why": offline_why} if args.agents else {})}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        print(_problem_header(problem))
        for device, why in offline_why.items():
            print(f"  left out, offline: {device} ({why})")
        print(_plan_table(problem, out))
        if args.out:
            print(f"plan written to {args.out}")
    return 0 if out.status in ("optimal", "ok") else 1


def _offline_devices(agents_file: str, problem: PlanningProblem) -> dict[str, str]:
    """The problem's devices whose agent (listed in ``agents_file``) does not answer: offline, each with why."""
    from core.devices.agent_link import unanswering_agents
    from core.devices.local_cluster import load_agents_file

    endpoints, keys = load_agents_file(agents_file)
    ids = set(problem.profile.cluster.device_ids())
    return unanswering_agents([e for e in endpoints if e.device in ids], keys)


def _problem_header(problem: PlanningProblem) -> str:
    m = problem.profile.model
    wl = problem.workload
    bound = problem.max_perplexity_increase
    quality = "" if bound is None else \
        f"\n  quality bound: perplexity at most {bound * 100:g} % above fp ({', '.join(allowed_precisions(problem))} allowed)"
    return (f"{problem.name or m.name}\n  model {m.name}: {m.num_units} units, {m.param_bytes / GIB:.2f} GiB of weights ({m.dtype}); "
            f"{len(problem.profile.cluster.devices)} devices, source {problem.source}; "
            f"batch {wl.batch_size}, prompt {wl.prompt_tokens}, generate {wl.generated_tokens}{quality}")


def _status_text(out: StrategyOutcomeLike) -> str:
    if isinstance(out, StrategyOutcome):
        return status_text(out)  # one wording for the CLI and the studio
    return out.status if not out.error else f"{out.status}: {out.error.splitlines()[0]}"


def _plan_table(problem: PlanningProblem, out: StrategyOutcome) -> str:
    plan, cost = out.plan, out.cost
    rows = [("stage", "device", "units", "#", "weights", "compute ms", "send ms", "memory GiB", "budget GiB", "")]
    for j, (st, mem) in enumerate(zip(plan.stages, cost.memory)):
        where = st.device if st.torch_device == "cpu" else f"{st.device} ({st.torch_device})"
        rows.append((str(j), where, f"[{st.start}, {st.end})", str(st.num_units), st.weights,
                     f"{cost.stage_compute_s[j] * 1e3:.2f}", f"{cost.stage_transfer_s[j] * 1e3:.2f}",
                     f"{mem.total_bytes / GIB:.2f}", f"{mem.budget_bytes / GIB:.2f}", "" if mem.fits else "OOM"))
    lines = [f"strategy {out.strategy}, objective {plan.objective}: {_status_text(out)}", _table(rows)]
    lines.append(
        f"latency {cost.latency_per_token_s * 1e3:.2f} ms/token (micro-batch of {cost.micro_batch_size}), "
        f"prefill {cost.prefill_s * 1e3:.1f} ms, throughput {cost.throughput_tokens_s:.2f} tokens/s "
        f"({cost.micro_batches} × {cost.micro_batch_size} sequences in flight), bottleneck stage {cost.bottleneck_stage}"
    )
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# --- compare ---------------------------------------------------------------------------

def cmd_techniques(args: argparse.Namespace) -> int:
    for t in techniques():
        print(f"{t.name}: {t.title}")
        print(f"  strategies: {', '.join(t.strategy_names())} (exact: {t.exact})")
        print(f"  stage kinds: {', '.join(t.stage_kinds)}; run modes: {', '.join(t.modes) or '-'}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    if args.draft:  # a draft the cost model cannot use is refused before any solve
        from core.runs.speculative import check_compare_draft

        check_compare_draft(args.draft)
    problems = load_problems(args)
    objectives = ("latency", "throughput") if args.objective == "both" else (args.objective,)
    technique = technique_named(args.technique)
    results = [(p, {o: technique.compare(p, o, args.time_limit) for o in objectives}) for p in problems]
    if args.json:
        doc = {"format": COMPARISON_FORMAT, "version": 1, "problems": [
            {"name": p.name, "model": p.profile.model.name,
             "objectives": {o: [_outcome_doc(x) for x in outs] for o, outs in by_obj.items()}}
            for p, by_obj in results
        ]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    for i, (p, by_obj) in enumerate(results):
        if i:
            print()
        print(_problem_header(p))
        for o, outs in by_obj.items():
            print(f"\n  objective: {o}")
            print(_compare_table(outs))
            if args.draft:
                from core.runs.speculative import compare_speculation

                print("\n  one sequence's decode tokens/s, plain -> speculative with the draft:")
                print("\n".join(f"    {line}" for line in compare_speculation(p, outs, args.draft)))
    return 0


def _compare_table(outs: list[StrategyOutcomeLike]) -> str:
    """Any technique's outcomes (core.techniques): layer sharding adds m×K and per-stage memory."""
    rows = [("strategy", "latency ms", "tokens/s", "m×K", "status")]
    details = []
    optimum = next((x for x in outs if isinstance(x, StrategyOutcome) and x.strategy == "edgeshard"), None)
    for x in outs:
        if x.plan is None or x.latency_s is None:
            rows.append((x.strategy, "—", "—", "—", _status_text(x)))
            details.append("")
            continue
        fits = x.status in ("optimal", "ok")
        m, k = getattr(x.cost, "micro_batch_size", None), getattr(x.cost, "micro_batches", None)
        status = _status_text(x)
        if x.strategy in PAPER_STRATEGIES and isinstance(x, StrategyOutcome):
            status += f" ({shortfall_text(x, optimum)})" if shortfall_text(x, optimum) else ""
        rows.append((x.strategy, f"{x.latency_s * 1e3:.1f}" if fits else "OOM" if x.status == "oom" else "—",
                     f"{x.tokens_per_s:.2f}" if fits else "—", f"{m}×{k}" if m else "—", status))
        stages = getattr(x.plan, "stages", None)
        details.append(" → ".join(
            f"{st.device}[{st.start},{st.end}){'' if st.weights == 'fp' else ' ' + st.weights}"
            f"{'' if st.torch_device == 'cpu' else ' ' + st.torch_device} "
            f"{mem.total_bytes / GIB:.1f}/{mem.budget_bytes / GIB:.1f} GiB"
            for st, mem in zip(stages, x.cost.memory)) if stages else "")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j and details[j - 1]:
            lines.append("      " + details[j - 1])
    return "\n".join(lines)


def _outcome_doc(x: StrategyOutcomeLike) -> dict:
    """The JSON shape of one strategy's result (documented in docs/formats.md)."""
    cost = getattr(x, "cost", None)
    return {
        "strategy": x.strategy, "objective": x.objective, "status": x.status, "error": x.error,
        "gap": getattr(x, "gap", 0.0), "bound": getattr(x, "bound", None), "elapsed_s": round(x.elapsed_s, 4),
        "plan": None if x.plan is None else msgspec.to_builtins(x.plan),
        "cost": None if cost is None else _cost_doc(cost),
    }


def _cost_doc(cost) -> dict:
    doc = msgspec.to_builtins(cost)
    if not hasattr(cost, "memory"):
        return doc  # another technique's cost: its own fields
    doc["feasible"] = cost.feasible
    for m, d in zip(cost.memory, doc["memory"]):
        d["total_bytes"], d["fits"] = m.total_bytes, m.fits
    return doc
