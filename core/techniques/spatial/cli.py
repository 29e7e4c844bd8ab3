"""``edgeshard spatial ...``: the technique's own verbs (registered through Technique.register_cli).

scenario writes a problem; compare/plan/simulate read one (and a plan); profile times this
machine's convolutions and fits the time model; run runs a plan on agents; calibrate fits the
cost model to real runs on agents. Errors are one line (EdgeShardError), exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from core.arguments import add_image_arguments, float_in, int_in
from core.formats import check_writable, load, save


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("spatial", help="CNN spatial partitioning (EdgeMI): scenario, compare, plan, simulate, profile",
                         description="Split a CNN's convolution maps into strips across devices (docs/spatial.md).")
    verbs = top.add_subparsers(dest="spatial_command", metavar="VERB", required=True)

    s = verbs.add_parser("scenario", help="write a problem shaped like EdgeMI's testbed")
    s.add_argument("--nodes", type=int_in(1, 64), default=4)
    s.add_argument("--bandwidth-mbps", type=float_in(0.0, 1e6, lo_open=True), default=1000.0)
    s.add_argument("--network", choices=("vgg16", "resnet-style"), default="vgg16")
    s.add_argument("--out", required=True, metavar="PROBLEM.json")
    s.set_defaults(func=_scenario)

    c = verbs.add_parser("compare", help="every partitioner side by side (fused, cbps, bodp, even)")
    c.add_argument("problem", metavar="PROBLEM.json")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_compare)

    p = verbs.add_parser("plan", help="one partitioner's plan")
    p.add_argument("problem", metavar="PROBLEM.json")
    p.add_argument("--strategy", choices=("fused", "cbps", "bodp", "even"), default="fused")
    p.add_argument("--out", metavar="PLAN.json")
    p.set_defaults(func=_plan)

    m = verbs.add_parser("simulate", help="a plan's predicted timeline and figures")
    m.add_argument("problem", metavar="PROBLEM.json")
    m.add_argument("plan", metavar="PLAN.json")
    m.add_argument("--images", type=int_in(1, 100_000), default=None)
    m.set_defaults(func=_simulate)

    r = verbs.add_parser("run", help="run a plan for real on agents: scatter strips, gather, head; checked "
                                     "against one device and recorded with its prediction")
    r.add_argument("problem", metavar="PROBLEM.json", help="its devices are named like the agents")
    r.add_argument("--agents", required=True, metavar="AGENTS.json")
    r.add_argument("--strategy", choices=("fused", "cbps", "bodp", "even"), default="fused")
    r.add_argument("--plan", metavar="PLAN.json", help="run this plan instead of planning with --strategy")
    add_image_arguments(r)
    r.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="of the generated weights and images")
    r.add_argument("--workspace", metavar="WS.sqlite", help="record the run and its prediction here "
                                                            "(default: the studio's workspace)")
    r.add_argument("--session", default="spatial", help="session name to record under")
    r.add_argument("--events", metavar="FILE", help="write timeline and token (class) events to this JSONL file")
    r.add_argument("--json", action="store_true", help="print one JSON object: every image's class and scores, "
                                                       "the measured and predicted time, the recorded runs")
    r.set_defaults(func=_run)

    k = verbs.add_parser("calibrate", help="fit the cost model to real runs on agents (the gateway alone, then "
                                           "even strips over every device) and write the calibrated problem")
    k.add_argument("problem", metavar="PROBLEM.json", help="its devices are named like the agents")
    k.add_argument("--agents", required=True, metavar="AGENTS.json")
    k.add_argument("--images", type=int_in(1, 1000), default=3)
    k.add_argument("--rounds", type=int_in(1, 100), default=2, help="runs per probe; the fastest counts")
    k.add_argument("--out", required=True, metavar="PROBLEM.json")
    k.set_defaults(func=_calibrate)

    f = verbs.add_parser("profile", help="time convolutions over map sizes and fit y = a·x + b (this machine, "
                                         "or every agent of --agents)")
    f.add_argument("--threads", type=int_in(1, 1024), default=None)
    f.add_argument("--agents", metavar="AGENTS.json", help="profile these agents (edgeshard cluster local writes one)")
    f.add_argument("--problem", metavar="PROBLEM.json", help="with --agents: give the devices of the same name "
                                                             "their measured time models")
    f.add_argument("--out", metavar="PROBLEM.json", help="with --problem: where to write the measured problem")
    f.set_defaults(func=_profile)


def run_images(args, size: int):
    """The N×3×size×size images ``args`` asks for (``add_image_arguments``)."""
    import torch

    from core.techniques.spatial.images import load_images
    from core.techniques.spatial.problem import SpatialInputError

    if args.image:
        if args.images is not None:
            raise SpatialInputError("give --image files or --images N random images, not both")
        return load_images(args.image, size)
    n = args.images or 4
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(args.seed))


def _agents_named_like(problem, endpoints, agents_file: str) -> None:
    """Every device of ``problem`` has an agent of that name in ``agents_file``: checked before
    connecting, so a mismatch is one line, not a failure after the agents were set to work."""
    from core.errors import FormatError

    names = {e.device for e in endpoints}
    missing = [d.id for d in problem.devices if d.id not in names]
    if missing:
        raise FormatError(agents_file, f"no agent named {', '.join(missing)} (agents: {', '.join(sorted(names))}); "
                          "the problem's devices must be named like the agents")


def _problem(path: str):
    from core.techniques.spatial.problem import SpatialProblem, check

    problem = load(path, SpatialProblem)
    check(problem)
    return problem


def _scenario(args) -> int:
    from core.techniques.spatial.scenarios import paper_shaped

    save(args.out, paper_shaped(args.nodes, args.bandwidth_mbps, network=args.network))
    print(f"wrote {args.out}")
    return 0


def _compare(args) -> int:
    from core.techniques.spatial.cost import single_device_seconds
    from core.techniques.spatial.strategies import compare

    problem = _problem(args.problem)
    one = single_device_seconds(problem)
    outs = compare(problem)
    if args.json:
        rows = [{"strategy": o.strategy, "status": o.status, "error": o.error, "latency_s": o.latency_s,
                 "speedup": one / o.latency_s if o.latency_s else None,
                 "devices": list(o.plan.devices) if o.plan else [], "groups": len(o.plan.groups) if o.plan else 0}
                for o in outs]
        print(json.dumps({"format": "edgeshard.spatial-comparison", "version": 1, "problem": problem.name,
                          "single_device_s": one, "strategies": rows}, indent=2))
        return 0
    print(f"{problem.name}: {problem.model.spec().name}, one device {one * 1e3:.1f} ms/image")
    print(f"  {'strategy':<8} {'ms/image':>9} {'speedup':>8} {'devices':>8} {'groups':>7}  status")
    for o in outs:
        if o.cost is None:
            print(f"  {o.strategy:<8} {'—':>9} {'—':>8} {'—':>8} {'—':>7}  {o.status}: {o.error}")
            continue
        print(f"  {o.strategy:<8} {o.latency_s * 1e3:9.1f} {one / o.latency_s:7.2f}× {len(o.plan.devices):>8} "
              f"{len(o.plan.groups):>7}  {o.status}")
    return 0


def _plan(args) -> int:
    from core.errors import EdgeShardError
    from core.techniques.spatial.strategies import run_strategy

    out = run_strategy(_problem(args.problem), args.strategy)
    if out.plan is None:
        raise EdgeShardError(out.error)
    if args.out:
        save(args.out, out.plan)
    sys.stdout.write(msgspec.json.encode(out.plan).decode() + "\n")
    return 0


def _simulate(args) -> int:
    from core.techniques.spatial.problem import SpatialPlan
    from core.techniques.spatial.simulator import simulate

    problem = _problem(args.problem)
    sim = simulate(problem, load(args.plan, SpatialPlan), images=args.images)
    f = sim.figures
    print(f"{f.tokens} images in {f.duration_s * 1e3:.1f} ms ({f.tokens / f.duration_s:.2f} images/s); "
          f"{len(sim.events)} timeline events; utilisation "
          + ", ".join(f"{d} {u:.0%}" for d, u in sorted(f.utilisation.items())))
    return 0


def _run(args) -> int:
    from core.devices.local_cluster import load_agents_file
    from core.errors import EdgeShardError
    from core.paths import workspace_file
    from core.sessions.recording import check_workspace
    from core.techniques.spatial.problem import SpatialPlan, check
    from core.techniques.spatial.run import on_agents
    from core.techniques.spatial.strategies import run_strategy

    problem = _problem(args.problem)
    workspace = args.workspace or workspace_file()
    check_workspace(workspace)  # before any agent works (or a plan is solved)
    if args.events:
        check_writable(args.events)
    if args.plan:
        plan = load(args.plan, SpatialPlan)
    else:
        out = run_strategy(problem, args.strategy)
        if out.plan is None:
            raise EdgeShardError(out.error)
        plan = out.plan
    check(problem, plan)
    if args.image:  # a bad image file before any agent is connected (random images: made once they answer)
        run_images(args, problem.model.spec().image)
    endpoints, keys = load_agents_file(args.agents)
    on_agents(problem, plan, [e.device for e in endpoints])  # enough agents: before connecting to them
    return _run_on_agents(endpoints, keys, problem, plan, args, workspace, args.session)


def run_plan_file(args, agents) -> int:
    """``edgeshard run --plan PLAN.json`` for a spatial plan: with its ``--problem``, on ``--agents``
    (``agents``: their endpoints and key, parsed by ``run``; None with ``--local``: one loopback agent
    per device of the plan), classifying ``--image`` files or
    ``--images`` random ones; recorded unless ``--no-record``."""
    import tempfile

    from core.devices.local_cluster import LocalCluster
    from core.errors import FormatError
    from core.sessions.recording import check_workspace
    from core.sessions.store import default_workspace_path
    from core.techniques.spatial.problem import SpatialPlan, check
    from core.techniques.spatial.run import on_agents

    if not args.problem:
        raise FormatError("edgeshard run", "a spatial CNN plan runs with the problem it was planned for: "
                                           "add --problem PROBLEM.json")
    if args.prompt or args.prompts or args.model:
        raise FormatError("edgeshard run", "a spatial CNN plan classifies images: give --image FILE (or "
                                           "--images N), not --model or prompts")
    problem, plan = _problem(args.problem), load(args.plan, SpatialPlan)
    check(problem, plan)  # before any agent is started or connected
    if args.image:  # a bad image file before local agents start (random images: made once they answer)
        run_images(args, problem.model.spec().image)
    workspace = "" if args.no_record else (args.workspace or str(default_workspace_path()))
    check_workspace(workspace)  # before any agent works
    if args.events:
        check_writable(args.events)
    session = f"edgeshard run {args.plan}"
    if agents is not None:
        endpoints, keys = agents
        on_agents(problem, plan, [e.device for e in endpoints])
        return _run_on_agents(endpoints, keys, problem, plan, args, workspace, session)
    with tempfile.TemporaryDirectory(prefix="edgeshard-spatial-") as tmp, \
            LocalCluster(tmp, len(plan.devices), link_mbit=args.link_mbit,
                         link_latency_ms=args.link_latency_ms) as lc:
        return _run_on_agents(lc.endpoints, lc.keys, problem, plan, args, workspace, session)


def _run_on_agents(endpoints, keys, problem, plan, args, workspace: str, session: str) -> int:
    """Run the images ``args`` asks for on the agents (the plan's devices named as them, ``on_agents``),
    check every image against one device, record the run and its prediction in ``workspace`` ("" : not
    recorded). The agents must answer first: a dead one is named before torch is imported here."""
    from core.devices.agent_link import AgentLink
    from core.techniques.spatial.run import on_agents

    problem, plan = on_agents(problem, plan, [e.device for e in endpoints])
    with AgentLink(endpoints, keys, heartbeat_timeout_s=30.0, request_timeout_s=120.0) as link:
        link.answering()
        from core.runs.wire import WireMeter
        from core.techniques.spatial.run import run_and_record
        from core.techniques.spatial.simulator import simulate

        images = run_images(args, problem.model.spec().image)
        link.sync_clocks()
        with _events_file(args) as events, WireMeter(link, plan.devices) as meter:
            def seen(mine, token, _result):
                for event in mine:
                    events.on_event(event)
                events.on_tokens(token)

            out = run_and_record(link, problem, plan, images, seed=args.seed, workspace=workspace, session=session,
                                 on_image=seen if events is not None else None)
    n = len(out.run.tokens)
    simulated = simulate(problem, plan, images=max(1, n))
    predicted = simulated.figures.duration_s
    wire = _wire(meter.traffic, plan, simulated.events, workspace, out.run_ids)
    if getattr(args, "json", False):
        print(json.dumps({"format": "edgeshard.spatial-run-output", "version": 1, "strategy": plan.strategy,
                          "images": [{"class": t.token_ids[0], "scores": list(sc)}
                                     for t, sc in zip(out.run.tokens, out.run.scores)],
                          "measured_s": out.run.figures.duration_s, "predicted_s": predicted,
                          "max_abs_error": out.max_abs_error, "status": out.status,
                          "run_ids": list(out.run_ids) or None, "wire": wire}))
        return 0 if out.max_abs_error < 1e-3 else 1
    recorded = (f"recorded runs {out.run_ids[0]} (measured) and {out.run_ids[1]} (predicted)" if out.run_ids
                else "not recorded")
    print(f"{n} images on {len(plan.devices)} agents ({plan.strategy}, {len(plan.groups)} tiles): "
          f"{out.run.figures.duration_s:.3f} s measured, {predicted:.3f} s predicted; "
          f"classes {[t.token_ids[0] for t in out.run.tokens]}; max |scores - one device| = "
          f"{out.max_abs_error:.2e}; {recorded}")
    if wire["measured_bytes"] is not None:
        print(f"wire: {wire['measured_bytes']} bytes between agents (the cost model: {wire['predicted_bytes']}, "
              f"x{wire['measured_over_predicted']}), {wire['control_bytes']} to the coordinator")
    return 0 if out.max_abs_error < 1e-3 else 1


def _wire(traffic, plan, simulated_events, workspace: str, run_ids) -> dict:
    """The strips the agents' sockets sent beside the simulated schedule's (the cost model's strip
    bytes: ``StripTime.in_bytes`` scattered by the gateway, drawn as the worker's ``recv_wait``, and
    ``out_bytes`` gathered back, its ``send``), each one frame with its header (``frame_header_bytes``;
    a worker's result relays its three times, ``StripRelay``), added to the measured run's recorded figures."""
    from agents.techniques.spatial.messages import StripRelay
    from core.runs.wire import frame_header_bytes, wire_figures
    from core.sessions.recording import add_run_figures

    predicted: dict[tuple[str, str], int] = {}
    for ev in simulated_events:
        if not ev.nbytes or not ev.peer or ev.peer == ev.device or ev.kind not in ("recv_wait", "send"):
            continue
        scatter = ev.kind == "recv_wait"  # the gateway's strip to the worker, else the worker's result back
        src, dst = (ev.peer, ev.device) if scatter else (ev.device, ev.peer)
        header = frame_header_bytes(kind="strip", phase="prefill", step=ev.step, micro_batch=ev.stage, sender=src,
                                    tensors=[("float32", (1, 1, 1, ev.nbytes // 4))], run_id="0" * 12,
                                    options=None if scatter else StripRelay(times=(0.0, 0.0, 0.0)))
        predicted[(src, dst)] = predicted.get((src, dst), 0) + ev.nbytes + header
    wire = wire_figures(traffic, plan.devices, predicted)
    if workspace and run_ids:
        add_run_figures(workspace, run_ids[0], {"wire": wire})
    return wire


def _events_file(args):
    """The ``--events`` JSONL sink (``core.runs.run_stream.EventsFile``), or a context of None."""
    from contextlib import nullcontext

    from core.runs.run_stream import EventsFile

    path = getattr(args, "events", None)
    return EventsFile(path) if path else nullcontext()


def _calibrate(args) -> int:
    from core.devices.agent_link import AgentLink
    from core.devices.local_cluster import load_agents_file
    from core.techniques.spatial.calibration import calibrate_on_agents

    problem = _problem(args.problem)
    check_writable(args.out)
    endpoints, keys = load_agents_file(args.agents)
    _agents_named_like(problem, endpoints, args.agents)
    with AgentLink(endpoints, keys, heartbeat_timeout_s=30.0, request_timeout_s=120.0) as link:
        link.answering()
        link.sync_clocks()
        cal = calibrate_on_agents(link, problem, images=args.images, rounds=args.rounds)
    save(args.out, cal.problem)
    print(json.dumps({"compute_scale": cal.compute_scale, "head_scale": cal.head_scale, "latency_s": cal.latency_s,
                      "tile_overhead_s": cal.tile_overhead_s, "worker_overhead_s": cal.worker_overhead_s,
                      "concurrency_scale": cal.concurrency_scale}))
    print(f"wrote {args.out}")
    return 0


def _profile(args) -> int:
    from core.errors import EdgeShardError
    from core.techniques.spatial.problem import fit_layer_time_model

    if args.agents is None:
        if args.problem or args.out:
            raise EdgeShardError("--problem and --out need --agents (the devices to profile)")
        from agents.techniques.spatial.network import layer_timing_samples

        fits = {"this machine": fit_layer_time_model(layer_timing_samples(threads=args.threads))}
    else:
        fits = _profile_agents(args)
    for device, fit in fits.items():
        print(json.dumps({"device": device, "a_s_per_flop": fit.a, "b_s": fit.b, "gflops": 1e-9 / fit.a,
                          "s_per_weight_byte": fit.per_weight_byte, "s_per_activation_byte": fit.per_activation_byte,
                          "median_rel_error": fit.median_rel_error}))
    return 0


def _profile_agents(args):
    from core.devices.local_cluster import load_agents_file
    from core.errors import EdgeShardError
    from core.devices.agent_link import AgentLink
    from core.techniques.spatial.profiling import profile_time_models, with_time_models

    problem = _problem(args.problem) if args.problem else None
    if args.out and problem is None:
        raise EdgeShardError("--out needs --problem (the problem whose devices get the measured models)")
    if args.out:
        check_writable(args.out)
    endpoints, keys = load_agents_file(args.agents)
    named = {d.id for d in problem.devices} & {e.device for e in endpoints} if problem is not None else set()
    if problem is not None and not named:  # before profiling, not after
        raise EdgeShardError(f"no agent of {args.agents} is named like a device of {args.problem} "
                             f"(agents: {', '.join(e.device for e in endpoints)}; "
                             f"devices: {', '.join(d.id for d in problem.devices)})")
    with AgentLink(endpoints, keys, heartbeat_timeout_s=30.0, request_timeout_s=300.0) as link:
        link.answering()
        fits = profile_time_models(link, [e.device for e in endpoints], threads=args.threads or 0)
    if problem is not None:
        measured = with_time_models(problem, fits)
        if args.out:
            save(args.out, measured)
            print(f"wrote {args.out} ({len(named)} devices measured)")
    return fits
