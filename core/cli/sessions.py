"""`edgeshard` sub-commands for sessions: simulate, sessions, export, replay, and
export-session / import-session (registered through the edgeshard.commands entry point).

The workspace is ``--workspace FILE``, else $EDGESHARD_WORKSPACE, else
~/.local/share/edgeshard/workspace.sqlite (see core.sessions.store.default_workspace_path).
Every user error is an EdgeShardError (printed by core.cli, exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from core.arguments import ROW_ID, float_in, int_in
from core.planning import cost

from core import formats
from core.errors import EdgeShardError, StoreError
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.sessions.recording import record_simulation
from core.sessions.replay import Replay
from core.runs.metrics import LiveMetrics, compute_figures
from core.runs.simulator import MODES, simulate, simulate_recorded
from core.sessions.store import SessionStore, default_workspace_path
from core.sessions.export import write_chrome_trace, write_events_csv, write_events_jsonl


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""

    def workspace_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workspace", metavar="FILE",
                       help="workspace file (default: $EDGESHARD_WORKSPACE or "
                            "~/.local/share/edgeshard/workspace.sqlite)")

    p = sub.add_parser("simulate", help="predict a plan's timeline and figures with the discrete-event simulator")
    p.add_argument("problem", metavar="PROBLEM.json", nargs="?")
    p.add_argument("--plan", metavar="PLAN.json")
    p.add_argument("--run", type=ROW_ID, metavar="RUN",
                   help="predict a recorded run (its problem, plan, mode and batches) and compare with what it measured")
    p.add_argument("--mode", choices=MODES, default="sequential")
    p.add_argument("--micro-batches", type=int_in(1, 4096), metavar="K", help="micro-batches in flight (default: the plan's)")
    p.add_argument("--micro-batch-size", type=int_in(1, 1 << 16), metavar="M", help="sequences per micro-batch (default: the plan's)")
    p.add_argument("--generated-tokens", type=int_in(1, 1 << 20), metavar="G", help="tokens per sequence (default: the workload's)")
    p.add_argument("--host-cores", type=int_in(1, 4096), metavar="N",
                   help="the devices are emulated on one host with N cores (a local cluster): they share them")
    p.add_argument("--events", metavar="OUT.jsonl", help="write the predicted TimelineEvents (JSON lines)")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    p.add_argument("--record", action="store_true", help="store the prediction as a simulated run in the workspace")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    workspace_arg(p)
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("sessions", help="list the sessions and runs of the workspace")
    workspace_arg(p)
    p.set_defaults(func=_cmd_sessions)

    p = sub.add_parser("export", help="export a run's timeline (Chrome trace, CSV) and its plan/profile JSON")
    p.add_argument("run", type=ROW_ID, metavar="RUN")
    p.add_argument("--trace", metavar="OUT.json")
    p.add_argument("--csv", metavar="OUT.csv")
    p.add_argument("--plan", metavar="PLAN.json")
    p.add_argument("--profile", metavar="PROFILE.json")
    workspace_arg(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("replay", help="replay a recorded run in the terminal")
    p.add_argument("run", type=ROW_ID, metavar="RUN")
    p.add_argument("--speed", type=float_in(0, 1e6, lo_open=True), default=1.0, help="replay speed factor (default 1)")
    workspace_arg(p)
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("export-session", help="write one session as a single file for another machine")
    p.add_argument("session", type=ROW_ID, metavar="SESSION")
    p.add_argument("out", metavar="OUT.edgeshard-session")
    workspace_arg(p)
    p.set_defaults(func=_cmd_export_session)

    p = sub.add_parser("import-session", help="add a session file to the workspace")
    p.add_argument("file", metavar="FILE")
    workspace_arg(p)
    p.set_defaults(func=_cmd_import_session)


def _open(args) -> SessionStore:
    store = SessionStore(args.workspace or default_workspace_path())
    if store.damage:
        print(f"warning: {store.path} is damaged, some sessions may be missing or unreadable "
              f"({'; '.join(store.damage)}); recover with `sqlite3 {store.path.name} .recover`", file=sys.stderr)
    return store


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} tok/s"


def _cmd_simulate(args) -> int:
    if args.run is not None:
        return _cmd_simulate_run(args)
    if not args.problem or not args.plan:
        raise EdgeShardError("give PROBLEM.json and --plan PLAN.json, or --run RUN")
    problem = formats.load(args.problem, PlanningProblem)
    plan = formats.load(args.plan, ShardPlan)
    try:
        res = simulate(problem, plan, args.mode, micro_batches=args.micro_batches,
                       micro_batch_size=args.micro_batch_size, generated_tokens=args.generated_tokens,
                       host_cores=args.host_cores)
    except ValueError as err:
        raise EdgeShardError(str(err)) from None
    m, k = res.micro_batch_size, res.micro_batches
    closed = {
        "step_time_s": cost.step_time_s(problem, plan, "decode", m),
        "prefill_s": cost.step_time_s(problem, plan, "prefill", m),
        "throughput_tokens_s": cost.throughput_tokens_s(problem, plan, m, k)[0],
    }
    f = res.figures
    figures = {"mode": res.mode, "micro_batch_size": m, "micro_batches": k, "generated_tokens": res.generated_tokens,
               **msgspec.to_builtins(f), "steady_tokens_per_s": res.steady_tokens_per_s,
               "link_wait_s": res.link_wait_s, "closed_form": closed}
    if args.events:
        write_events_jsonl(args.events, res.events)
    if args.trace:
        write_chrome_trace(args.trace, res.events, res.tokens, source_device=problem.source,
                           metadata={"mode": res.mode, "kind": "simulated"})
    if args.record:
        with _open(args) as store:
            sid = store.create_session(f"simulate {problem.name or args.problem}")
            store.add_devices(sid, problem.profile.cluster.devices)
            figures["run"] = record_simulation(store, sid, problem, plan, res)
            figures["session"] = sid
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return 0
    print(f"{res.mode}: {k} micro-batch(es) of {m}, {res.generated_tokens} tokens each, {len(plan.stages)} stages")
    print(f"  TTFT               {_fmt_s(f.ttft_s):>14}   (closed form prefill, one micro-batch: {_fmt_s(closed['prefill_s'])})")
    print(f"  per-token latency  {_fmt_s(f.per_token_latency_s):>14}   (closed form step: {_fmt_s(closed['step_time_s'])})")
    print(f"  decode throughput  {_fmt_rate(f.decode_tokens_per_s):>14}   steady state {_fmt_rate(res.steady_tokens_per_s)}"
          f"   (closed form, no bubbles: {_fmt_rate(closed['throughput_tokens_s'])})")
    print(f"  overall            {_fmt_rate(f.tokens_per_s):>14}   {f.tokens} tokens in {_fmt_s(f.duration_s)}")
    print(f"  link waits         {_fmt_s(res.link_wait_s):>14}   (transfers queued behind another on a busy link)")
    print("  utilisation        " + ", ".join(f"{d} {u * 100:.0f}%" for d, u in f.utilisation.items()))
    if args.record:
        print(f"recorded as run {figures['run']} (session {figures['session']})")
    return 0


_COMPARED = (("ttft_s", "TTFT"), ("per_token_latency_s", "per-token latency"),
             ("decode_tokens_per_s", "decode throughput"))


def _cmd_simulate_run(args) -> int:
    with _open(args) as store:
        run = store.run(args.run)
        problem = store.problem_of(args.run)
        if problem is None or run.plan_id is None:
            raise StoreError(f"run {run.id} was recorded without its problem and plan; nothing to predict from")
        plan = store.plan(run.plan_id)
        items = store.timeline(args.run)
    tokens = [i.tokens for i in items if i.tokens is not None]
    events = [i.event for i in items if i.event is not None]
    try:
        res = simulate_recorded(problem, plan, run.mode, tokens)
    except ValueError as err:
        raise EdgeShardError(f"run {run.id}: {err}") from None
    measured = compute_figures(events, tokens)
    rows = []
    for key, label in _COMPARED:
        pred, meas = getattr(res.figures, key), getattr(measured, key)
        err = (pred / meas - 1) if pred is not None and meas else None
        rows.append({"figure": key, "label": label, "predicted": pred, "measured": meas, "error": err})
    if args.json:
        print(json.dumps({"run": run.id, "mode": res.mode, "micro_batches": res.micro_batches,
                          "micro_batch_size": res.micro_batch_size, "generated_tokens": res.generated_tokens,
                          "figures": rows}, sort_keys=True))
        return 0
    print(f"run {run.id} ({run.kind} {res.mode}, {res.micro_batches} micro-batch(es) of {res.micro_batch_size}, "
          f"{res.generated_tokens} tokens): predicted vs measured")
    print(f"  {'':<18} {'predicted':>14}  {'measured':>14}  {'error':>9}")
    for r in rows:
        fmt = _fmt_rate if r["figure"] == "decode_tokens_per_s" else _fmt_s
        err = "-" if r["error"] is None else f"{r['error'] * 100:+.1f} %"
        print(f"  {r['label']:<18} {fmt(r['predicted']):>14}  {fmt(r['measured']):>14}  {err:>9}")
    return 0


def _cmd_sessions(args) -> int:
    with _open(args) as store:
        sessions = store.sessions()
        if not sessions:
            print(f"no sessions in {store.path}")
            return 0
        for s in sessions:
            print(f"session {s.id}  {s.name}  ({s.created_at})")
            for r in store.runs(s.id):
                f = r.figures
                print(f"  run {r.id:<4} {r.kind:<9} {r.mode:<11} {r.status:<10} {r.model}"
                      f"  TTFT {_fmt_s(f.get('ttft_s'))}  per-token {_fmt_s(f.get('per_token_latency_s'))}"
                      f"  {_fmt_rate(f.get('decode_tokens_per_s'))}"
                      + (f"  plan {r.plan_id} re-planned to {r.final_plan_id}" if r.final_plan_id is not None else ""))
    return 0


def _cmd_export(args) -> int:
    if not (args.trace or args.csv or args.plan or args.profile):
        raise EdgeShardError("nothing to export: give --trace, --csv, --plan and/or --profile")
    with _open(args) as store:
        run = store.run(args.run)
        items = store.timeline(args.run)
        events = [i.event for i in items if i.event is not None]
        tokens = [i.tokens for i in items if i.tokens is not None]
        problem = store.problem_of(args.run)
        if args.trace:
            write_chrome_trace(args.trace, events, tokens,
                               source_device=problem.source if problem else None,
                               metadata={"run": run.id, "mode": run.mode, "kind": run.kind, "model": run.model})
            print(f"wrote {args.trace} ({len(events)} events; open in https://ui.perfetto.dev or chrome://tracing)")
        if args.csv:
            write_events_csv(args.csv, events)
            print(f"wrote {args.csv} ({len(events)} events)")
        if args.plan:
            if run.plan_id is None:
                raise StoreError(f"run {run.id} has no plan stored")
            formats.save(args.plan, store.plan(run.plan_id))
            print(f"wrote {args.plan}")
        if args.profile:
            if run.profile_id is None:
                raise StoreError(f"run {run.id} has no profile stored")
            formats.save(args.profile, store.profile(run.profile_id))
            print(f"wrote {args.profile}")
    return 0


def _cmd_replay(args) -> int:
    if args.speed <= 0:
        raise EdgeShardError("--speed must be positive")
    with _open(args) as store:
        run = store.run(args.run)
        replay = Replay.from_store(store, args.run, speed=args.speed)
    print(f"replaying run {run.id} ({run.kind} {run.mode}, {run.model}): {len(replay.items)} items over "
          f"{_fmt_s(replay.duration_s)} at {args.speed:g}x")
    live = LiveMetrics()
    n_events = 0
    out = sys.stdout
    for item in replay.play():
        if item.event is not None:
            live.add_event(item.event)
            n_events += 1
            continue
        tok = item.tokens
        live.add_tokens(tok)
        f = live.figures()
        piece = "".join(tok.text) if tok.text else " ".join(str(t) for t in tok.token_ids)
        out.write(f"[{item.recv_s:8.3f} s] step {tok.step:<4} mb {tok.micro_batch:<3} {piece!r:<24} "
                  f"{f.tokens:>6} tokens  {n_events:>7} events  TTFT {_fmt_s(f.ttft_s)}\n")
        out.flush()
    f = live.figures()
    print(f"done: {f.tokens} tokens, TTFT {_fmt_s(f.ttft_s)}, per-token {_fmt_s(f.per_token_latency_s)}, "
          f"decode {_fmt_rate(f.decode_tokens_per_s)}")
    print("utilisation: " + ", ".join(f"{d} {u * 100:.0f}%" for d, u in f.utilisation.items()))
    return 0


def _cmd_export_session(args) -> int:
    with _open(args) as store:
        path = store.export_session(args.session, args.out)
    print(f"wrote session {args.session} to {path}")
    return 0


def _cmd_import_session(args) -> int:
    with _open(args) as store:
        sid = store.import_session(args.file)
        runs = store.runs(sid)
    print(f"imported as session {sid} with {len(runs)} run(s): " + ", ".join(str(r.id) for r in runs))
    return 0

