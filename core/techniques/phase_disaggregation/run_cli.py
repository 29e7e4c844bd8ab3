"""``edgeshard epd make-model | profile | run``: the real half of EPD from the command line.

``make-model`` writes a tiny Llava checkpoint; ``profile`` measures ``PhaseCosts`` on the
agents with the studio's ``on_agents.measure_costs`` (every phase on every agent: per-device
costs, for ``epd simulate`` / ``epd search`` / ``epd run --costs``); ``run`` serves a workload
on them for real, checks the tokens against the single-process model if asked, prints TTFT/TPOT
and each device's phases beside the simulator's for the same costs, and records the run (and
the simulation) in the session store, so the studio replays them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

from core.arguments import SEED, float_in, int_in
from core.formats import check_writable, load, save


def register_run_verbs(verbs: argparse._SubParsersAction) -> None:
    mk = verbs.add_parser("make-model", help="write a tiny Llava checkpoint (random weights, fixed seed)")
    mk.add_argument("--out", required=True, metavar="DIR")
    mk.add_argument("--layers", type=int_in(1, 64), default=2)
    mk.add_argument("--hidden", type=int_in(8, 8192), default=64)
    mk.add_argument("--vision-layers", type=int_in(1, 64), default=2)
    mk.add_argument("--vision-hidden", type=int_in(8, 4096), default=32)
    mk.add_argument("--seed", type=SEED, default=0)
    mk.set_defaults(func=_make_model)

    for name, helptext in (("profile", "measure every phase on every agent: per-device PhaseCosts (COSTS.json); "
                                       "loads EPD's phases on the agents in place of what they hold"),
                           ("run", "serve a workload on the pools' agents for real; record it")):
        p = verbs.add_parser(name, help=helptext)
        p.add_argument("--agents", required=True, metavar="AGENTS.json", help="the agents file (edgeshard cluster)")
        p.add_argument("--model", required=True, metavar="DIR", help="a Llava checkpoint the agents can read")
        if name == "profile":
            which = p.add_mutually_exclusive_group()
            which.add_argument("--devices", metavar="A,B,...", help="the agents to measure (default: every agent "
                               "in the agents file)")
            which.add_argument("--pools", metavar="POOLS.json", help="measure the agents of these pools (their devices)")
        else:
            p.add_argument("--pools", required=True, metavar="POOLS.json", help="which agent serves which phase")
        p.add_argument("--transfers", choices=("data-plane", "relay"), default="data-plane",
                       help="tokens and KV caches agent to agent (default), or through the coordinator")
        if name == "profile":
            p.add_argument("--out", required=True, metavar="COSTS.json")
            p.add_argument("--repeats", type=int_in(1, 100), default=3, help="each probe's repeats (median kept)")
            p.set_defaults(func=_profile)
        else:
            p.add_argument("--workload", required=True, metavar="WORKLOAD.json")
            p.add_argument("--images", nargs="+", metavar="IMAGE", help="image files (default: the shipped set)")
            p.add_argument("--costs", metavar="COSTS.json", help="also simulate with these costs, side by side")
            p.add_argument("--temperature", type=float_in(0.0, 100.0), default=0.0)
            p.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), default=1.0)
            p.add_argument("--top-k", type=int_in(0, 1 << 20), default=0)
            p.add_argument("--seed", type=SEED, default=0)
            p.add_argument("--check", action="store_true", help="compare the tokens with generate() here")
            p.add_argument("--workspace", metavar="WS.sqlite", help="record here (default: the studio's)")
            p.add_argument("--session", default="epd", help="session name to record under")
            p.add_argument("--json", action="store_true", help="print one JSON object: every request's token ids "
                           "and text, the latency figures, the recorded run")
            p.add_argument("--events", metavar="FILE", help="write the run's timeline and token events to this "
                           "JSONL file as they happen (each line flushed)")
            p.set_defaults(func=_run)


def _make_model(args) -> int:
    check_writable(args.out, folder=True)  # before torch and transformers are imported (~2 s, more under load)
    from core.models.multimodal import MultimodalRecipe, make_multimodal_model
    from core.reporting import TerminalReporter

    heads = max(2, args.hidden // 16)
    recipe = MultimodalRecipe(layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=max(1, heads // 2),
                              intermediate=2 * args.hidden, vision_layers=args.vision_layers,
                              vision_hidden=args.vision_hidden, vision_heads=max(1, args.vision_hidden // 16),
                              seed=args.seed)
    path = make_multimodal_model(recipe, args.out, TerminalReporter())
    print(f"wrote a Llava checkpoint to {path} ({recipe.tokens_per_tile} tokens per {recipe.tile}-px tile)")
    return 0


@contextlib.contextmanager
def _agents(args, devices=None, named_by: str = ""):
    """(the devices, an open link to the agents) after every check that needs neither agent nor torch
    (the model is a Llava checkpoint from config.json, an agent in the agents file for every device
    ``named_by`` names; ``devices`` None: every agent in the file), then every one of them answering
    (a dead one named in seconds). A bad input is one line before any agent is set to work."""
    from core.devices.agent_link import AgentLink
    from core.devices.local_cluster import load_agents_file
    from core.errors import FormatError
    from core.models.multimodal import check_multimodal_dir

    check_multimodal_dir(args.model)
    endpoints, keys = load_agents_file(args.agents)
    known = [e.device for e in endpoints]
    devices = tuple(dict.fromkeys(devices if devices is not None else known))
    missing = [d for d in devices if d not in known]
    if missing:
        raise FormatError(args.agents, f"no agent named {', '.join(missing)}, {named_by} "
                                       f"(agents: {', '.join(known)})")
    if not devices:
        raise FormatError(args.agents, "no agents to measure: name at least one")
    with AgentLink(endpoints, keys, heartbeat_timeout_s=30.0, request_timeout_s=120.0) as link:
        link.answering(list(devices))
        yield devices, link


@contextlib.contextmanager
def _pool_agents(args):
    """(pools, an open link to their agents) after ``_agents``' checks for the pools' devices, then what
    the real run serves (imports torch)."""
    from core.techniques.phase_disaggregation.types import PoolConfig

    pools = load(args.pools, PoolConfig)
    with _agents(args, pools.devices, f"which {args.pools} puts in a pool") as (_devices, link):
        from core.techniques.phase_disaggregation.runtime import check_real_pools

        check_real_pools(pools)
        yield pools, link


def _profile(args) -> int:
    """The studio's measurement (``measure_costs``: every phase timed on every agent), one line per step."""
    from core.techniques.phase_disaggregation.types import PoolConfig

    check_writable(args.out)
    if args.pools:
        devices, named_by = load(args.pools, PoolConfig).devices, f"which {args.pools} puts in a pool"
    elif args.devices:
        devices, named_by = tuple(d.strip() for d in args.devices.split(",") if d.strip()), "which --devices names"
    else:
        devices, named_by = None, ""
    with _agents(args, devices, named_by) as (devices, link):
        from core.reporting import TerminalReporter
        from core.techniques.phase_disaggregation.on_agents import measure_costs

        costs = measure_costs(link, args.model, devices, repeats=args.repeats, transfers=args.transfers,
                              reporter=TerminalReporter())
    save(args.out, costs)
    from core.techniques.phase_disaggregation.on_agents import per_device_text

    print(f"wrote {args.out}: {per_device_text(costs)}")
    return 0


def _run(args) -> int:
    from pathlib import Path

    from agents.protocol import SamplingSpec
    from core.paths import workspace_file
    from core.sessions.recording import check_workspace
    from core.runs.wire import wire_figures
    from core.sessions.store import SessionStore
    from core.techniques.phase_disaggregation.types import PhaseCosts, Workload

    workload = load(args.workload, Workload)
    costs = load(args.costs, PhaseCosts) if args.costs else None
    workspace = args.workspace or workspace_file()
    check_workspace(workspace)  # recorded after the run: a bad path must fail before it
    if args.events:
        check_writable(args.events)
    sampling = SamplingSpec(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    with _pool_agents(args) as (pools, link):
        from core.techniques.phase_disaggregation.runtime import (
            load_pools, prepare_requests, record_epd_run, reference_tokens, run_epd,
        )
        from core.techniques.phase_disaggregation.simulator import record_simulation, simulate_pools

        from core.runs.run_stream import EventsFile
        from core.runs.wire import WireMeter

        prepared = prepare_requests(args.model, workload, [Path(p) for p in args.images] if args.images else None)
        link.sync_clocks()
        with (EventsFile(args.events) if args.events else contextlib.nullcontext()) as events:
            load_pools(link, args.model, pools)  # loading is not the run's traffic
            with WireMeter(link, pools.devices) as meter:
                run = run_epd(link, args.model, workload, pools, prepared=prepared, sampling=sampling,
                              transfers=args.transfers, sink=events, load=False)
    sim = simulate_pools(costs, workload, pools, record=True) if costs is not None else None
    equal = run.tokens == reference_tokens(args.model, prepared, sampling) if args.check else None
    with SessionStore(workspace) as store:
        session = store.create_session(args.session)
        model = Path(args.model).name
        run_id = record_epd_run(store, session, run, model=model, workload=workload, pools=pools)
        sim_id = None if sim is None else record_simulation(store, session, sim, model=model, workload=workload,
                                                            pools=pools)
        wire = wire_figures(meter.traffic, pools.devices, predicted_frames(sim.events, sampling) if sim is not None else None)
        store.add_figures(run_id, {"wire": wire})
    texts = _texts(args.model, run.tokens)
    med = statistics.median
    out = {"format": "edgeshard.epd-run-output", "version": 1, "requests": len(run.metrics), "ttft_p50_s": med(m.ttft_s for m in run.metrics),
           "tpot_p50_s": med(m.tpot_s for m in run.metrics), "e2e_p50_s": med(m.e2e_s for m in run.metrics),
           "run_id": run_id, "tokens_equal": equal, "wire": wire,
           "outputs": [{"request": rid, "tokens": list(run.tokens[rid]), "text": texts[rid]} for rid in sorted(run.tokens)]}
    if sim is not None:
        from core.techniques.phase_disaggregation.on_agents import phase_fit

        out.update(simulated_ttft_p50_s=med(m.ttft_s for m in sim.metrics),
                   simulated_tpot_p50_s=med(m.tpot_s for m in sim.metrics), simulated_run_id=sim_id,
                   phases=[dict(device=f.device, phase=f.phase, predicted_s=f.predicted_s, measured_s=f.measured_s,
                                ratio=f.ratio) for f in phase_fit(sim.metrics, run.metrics)])
    if args.json:
        print(json.dumps(out))
    else:
        for o in out["outputs"]:
            print(f"[{o['request']}] {o['text']!r} {o['tokens']}")
        line = (f"{out['requests']} requests on {len(pools.devices)} agents: TTFT p50 {out['ttft_p50_s']:.3f} s, "
                f"TPOT p50 {out['tpot_p50_s'] * 1e3:.1f} ms, E2E p50 {out['e2e_p50_s']:.2f} s; recorded run {run_id}")
        if sim is not None:
            line += (f"; simulated TTFT p50 {out['simulated_ttft_p50_s']:.3f} s, TPOT p50 "
                     f"{out['simulated_tpot_p50_s'] * 1e3:.1f} ms (run {sim_id})")
        if equal is not None:
            line += f"; tokens {'equal' if equal else 'DIFFER from'} the single-process generate()"
        print(line)
        for f in out.get("phases", ()):  # each device's phases with its own costs (per request; decode per token)
            print(f"  {f['device']} {f['phase']}{'/token' if f['phase'] == 'decode' else ''}: simulated "
                  f"{f['predicted_s'] * 1e3:.1f} ms, measured {f['measured_s'] * 1e3:.1f} ms (x{f['ratio']:.2f})")
        if wire["measured_bytes"] is not None:
            print(f"wire: {wire['measured_bytes']} bytes between agents (the simulator's transfers: "
                  f"{wire['predicted_bytes']}, x{wire['measured_over_predicted']}), {wire['control_bytes']} to the "
                  "coordinator")
    return 0 if equal in (None, True) else 1


def predicted_frames(events, sampling) -> dict[tuple[str, str], int]:
    """(src, dst) → bytes EPD's simulated transfers (the cost model's ``mm_token_bytes`` / ``kv_token_bytes``
    terms) put on the wire as the agents send them: each transfer one frame with its header
    (``core.runs.wire.frame_header_bytes``), and beside each KV cache the prefill agent's handoff in a frame
    of its own (``handoff_bytes``: the first token, and for a sampled run the sampler's state)."""
    from core.runs.wire import frame_header_bytes
    from core.techniques.phase_disaggregation.simulator import STAGE_PREFILL

    handoff = handoff_bytes(sampling)
    out: dict[tuple[str, str], int] = {}
    for ev in events:
        src = ev.device.removesuffix(":link")
        if ev.kind != "send" or not ev.peer or ev.peer == src:
            continue
        kind = "kv" if ev.stage == STAGE_PREFILL else "mm"
        frames = [ev.nbytes] + ([handoff] if kind == "kv" else [])
        out[(src, ev.peer)] = out.get((src, ev.peer), 0) + sum(n + frame_header_bytes(
            kind=kind, phase="prefill", step=ev.micro_batch, micro_batch=piece, sender=src,
            tensors=[("float32", (n // 4,))], run_id="0" * _RUN_ID_CHARS) for piece, n in enumerate(frames))
    return out


_RUN_ID_CHARS = 12
"""An EPD run's id on its frames (``runtime``'s ``uuid4().hex[:12]``)."""


def handoff_bytes(sampling) -> int:
    """Bytes of the handoff a prefill agent sends beside each KV cache (its ``handoff_tensor``): the first
    token and, unless greedy, the state of torch's CPU generator packed four bytes to a float32 (5,064 B
    sampled, 8 B greedy: a greedy prefill never draws, so sends no state)."""
    import torch

    from agents.techniques.phase_disaggregation.links import handoff_tensor
    from agents.techniques.phase_disaggregation.phases import sampling_params

    greedy = sampling_params(sampling, 1).greedy
    return handoff_tensor(0, b"" if greedy else torch.Generator().get_state().numpy().tobytes()).nbytes


def _texts(model_dir: str, tokens: dict[int, tuple[int, ...]]) -> dict[int, str]:
    """Each request's generated text (its tokens decoded by the checkpoint's tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return {rid: tok.decode(list(ids), skip_special_tokens=True) for rid, ids in tokens.items()}
