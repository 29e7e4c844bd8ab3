"""``edgeshard attention-offload run``: a Lamina split run on agents, recorded in the workspace.

The compute agent runs the dense part, the memory agents hold the KV cache and attention
(``core.techniques.attention_offload.run``). Tokens and text stream as they come; the run is
recorded through ``core.sessions.recording.record_run`` (the same rows as ``edgeshard run``), so
``edgeshard sessions`` lists it and the Sessions screen replays its timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from core.arguments import SEED, THREADS, TOKENS, float_in
from core.errors import FormatError


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("attention-offload", help="attention offloading (Lamina): run a split on agents")
    verbs = top.add_subparsers(dest="offload_command", metavar="VERB", required=True)
    r = verbs.add_parser("run", help="run the dense part on a compute agent and attention + KV on memory agents; "
                                     "records the run (replayable in Sessions)")
    r.add_argument("--model", required=True, help="checkpoint directory (HF layout, llama/qwen2/mistral/gpt2)")
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--agents", help="agents.json (from `cluster local` or deploy)")
    where.add_argument("--local", action="store_true", help="start the named agents on this machine for this run")
    r.add_argument("--compute", required=True,
                   help="the compute device(s), comma separated: each holds the whole dense part; several "
                        "run Lamina's staggered pipelining (--schedule, --micro-batches)")
    r.add_argument("--schedule", choices=("rotational", "fixed"), default="rotational",
                   help="staggering over several compute devices: batches move between them (rotational) or "
                        "each stays on one (fixed)")
    r.add_argument("--micro-batches", type=TOKENS, default=None,
                   help="batches in flight over the compute devices (default: one per compute device + 1)")
    r.add_argument("--memory", required=True,
                   help="memory devices, comma separated (each holds the KV of a share of the key/value heads)")
    r.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    r.add_argument("--max-new-tokens", type=TOKENS, default=32)
    r.add_argument("--temperature", type=float_in(0, 100), default=0.0, help="0 = greedy")
    r.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0)
    r.add_argument("--seed", type=SEED, default=0)
    r.add_argument("--threads", type=THREADS, default=0, help="torch threads per agent (0 = agent default)")
    r.add_argument("--profile", metavar="PROFILE.json", help="the agents' measured profile (edgeshard profile): "
                   "the run records the problem it makes of them and the split as its origin, so its replay in "
                   "Sessions draws the predicted timeline beside it (without it: no prediction)")
    r.add_argument("--workspace", help="workspace file (default: the studio's)")
    r.add_argument("--no-record", action="store_true", help="do not record the run in the workspace")
    r.add_argument("--events", metavar="FILE", help="write timeline and token events to this JSONL file")
    r.add_argument("--json", action="store_true", help="print one JSON object at the end: every sequence's token "
                   "ids and text, the figures, the recorded run")
    r.set_defaults(func=_run)


def memory_devices(text: str, compute: str | list[str]) -> list[str]:
    """The ``--memory`` list, checked: names, none repeated, not a compute device."""
    names = [n.strip() for n in text.split(",")]
    compute = [compute] if isinstance(compute, str) else compute
    if not all(names):
        raise FormatError("--memory", "give device names separated by commas, e.g. mem-0,mem-1")
    if len(set(names)) != len(names) or set(compute) & set(names):
        raise FormatError("--memory", "each memory device once, and not the compute device")
    return names


def _run(args) -> int:
    from core.devices.agent_link import ANSWER_WITHIN_S
    from core.devices.local_cluster import LocalCluster, load_agents_file
    from core.models.units import load_model_spec
    from core.runs.coordinator import Coordinator, FanoutSink
    from core.formats import check_writable
    from core.runs.generation import GenerationSettings, generate_with, generation_json, settings_problem
    from core.runs.run_stream import EventsFile
    from core.runs.wire import WireMeter
    from core.sessions.recording import add_run_figures, check_workspace, record_run
    from core.sessions.store import default_workspace_path
    from core.techniques.run_origin import recorded_origin

    compute = [n.strip() for n in args.compute.split(",")]
    if not all(compute) or len(set(compute)) != len(compute):
        raise FormatError("--compute", "give device names separated by commas, each once, e.g. c0,c1")
    memory = memory_devices(args.memory, compute)
    if not args.prompt:
        raise FormatError("edgeshard attention-offload run", "give --prompt TEXT (repeatable)")
    if not Path(args.model, "config.json").exists():
        raise FormatError(args.model, "not a checkpoint directory (no config.json)")
    model_dir = os.path.abspath(args.model)
    staggered = len(compute) > 1 or args.micro_batches is not None
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed, threads=args.threads,
                                  micro_batches=(args.micro_batches or len(compute) + 1) if staggered else None)
    devices = [*compute, *memory]
    workspace = None if args.no_record else (args.workspace or default_workspace_path())
    # every check before any agent starts: the settings, the model's family, the workspace, the agents
    # named, and the heads the memory agents split (the agents' own rule; imports torch, so last)
    problem = settings_problem(settings)
    if problem:
        raise FormatError("run settings", problem[1], problem[0])
    load_model_spec(model_dir)
    check_workspace(workspace)
    if args.events:
        check_writable(args.events)
    agents = None if args.local else load_agents_file(args.agents)
    if agents is not None:
        missing = sorted(set(devices) - {e.device for e in agents[0]})
        if missing:
            raise FormatError(args.agents, f"no agent named {', '.join(missing)} "
                                           f"(agents: {', '.join(e.device for e in agents[0])})")
        from core.devices.agent_link import AgentLink

        # every named agent answers before torch is imported here (tens of seconds on a loaded machine)
        with AgentLink([e for e in agents[0] if e.device in devices], agents[1], heartbeat_timeout_s=30.0) as link:
            link.answering()
    from agents.checkpoint_reader import CheckpointError
    from core.techniques.attention_offload.run import checkpoint_model, head_ranges, run_offload, run_staggered

    try:
        head_ranges(checkpoint_model(model_dir).kv_heads, len(memory))
    except CheckpointError as err:
        raise FormatError("--memory", str(err)) from None
    origin = run_plan = width = None
    if workspace is not None and args.profile:
        origin, run_plan, width = run_origin(args.profile, model_dir, compute, memory, args.prompt, settings,
                                             args.schedule)
    recording = nullcontext() if workspace is None else record_run(
        workspace, model=Path(model_dir).name, mode="sequential",
        settings={"technique": "attention-offload", "model_dir": model_dir, "prompts": args.prompt,
                  "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "seed": args.seed, "compute": compute, "memory": memory, "lanes": devices,
                  "schedule": args.schedule if staggered else "", "micro_batches": settings.micro_batches,
                  "started_by": "edgeshard attention-offload run", "prompt_tokens": width},
        session_name=f"attention offload {time.strftime('%Y-%m-%d %H:%M')}", plan=run_plan,
        origin=recorded_origin(origin) if origin is not None else None)
    cluster = tmp = None
    try:
        if args.local:
            tmp = tempfile.TemporaryDirectory(prefix="edgeshard-offload-")
            cluster = LocalCluster(tmp.name, devices, threads_per_agent=args.threads or 1)
            endpoints, keys = cluster.start(), cluster.keys
        else:
            endpoints, keys = agents
        with recording as rec, Coordinator(endpoints, keys) as coordinator, \
                (EventsFile(args.events) if args.events else nullcontext()) as events:
            coordinator.wait_ready(timeout_s=ANSWER_WITHIN_S)
            coordinator.sync_clocks()
            meter = WireMeter(coordinator, devices)
            sink = rec.recorder if rec is not None else None
            def run(request, s):
                s = FanoutSink(s, sink, events)
                if staggered:
                    return run_staggered(coordinator, model_dir, compute, memory, request, schedule=args.schedule,
                                         sink=s, threads=args.threads)
                return run_offload(coordinator, model_dir, compute[0], memory, request, sink=s, threads=args.threads)

            with meter:
                out = generate_with(run, model_dir, args.prompt, settings)
            if rec is not None:
                rec.status = "completed"
        wire = _wire(model_dir, memory, args.prompt, out, meter.traffic, devices)
        if rec is not None:
            add_run_figures(workspace, rec.run_id, {"wire": wire})
    finally:
        if cluster is not None:
            cluster.stop()
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps({**generation_json(out, rec.run_id if rec is not None else None, "sequential"),
                          "wire": wire}))
        return 0
    for i, (p, t) in enumerate(zip(args.prompt, out.texts)):
        print(f"[{i}] {p}{t}")
    f = out.figures
    ms = lambda v: "n/a" if v is None else f"{v * 1e3:.1f} ms"  # noqa: E731
    print(f"TTFT {ms(f.ttft_s)}  per-token latency {ms(f.per_token_latency_s)}  tokens {f.tokens}  "
          f"compute {', '.join(compute)}  memory {', '.join(memory)}"
          + (f"  {args.schedule} staggering, {settings.micro_batches} batches" if staggered else ""))
    if wire["measured_bytes"] is not None:
        print(f"wire: {wire['measured_bytes']} bytes of attention frames (the cost model: {wire['predicted_bytes']}, "
              f"x{wire['measured_over_predicted']}), {wire['control_bytes']} to the coordinator")
    if rec is not None:
        print(f"recorded as run {rec.run_id} (session {rec.session_id}) in {workspace}")
    sys.stdout.flush()
    return 0


def run_origin(profile_file: str, model_dir: str, compute: list[str], memory: list[str], prompts: list[str],
               settings, schedule: str):
    """What predicts this run, recorded with it (its replay's ghosts), as the Run screen's ``PlanOrigin``:
    the profiled agents as attention offloading's problem for this checkpoint, these prompts' width and
    tokens, and the split run as its plan; with its ``ShardPlan`` and the width. A profile without one of
    the named devices is refused (``FormatError``), before any agent starts."""
    from core import formats
    from core.devices.profile import Profile
    from core.runs.prediction import PlanOrigin, run_prompt_tokens
    from core.techniques import technique_named
    from core.techniques.attention_offload.measured import problem_from_profile
    from core.techniques.attention_offload.problem import OffloadPlan, OffloadWorkload
    from core.techniques.attention_offload.run import checkpoint_model

    profile = formats.load(profile_file, Profile)
    missing = [d for d in (*compute, *memory) if d not in profile.cluster.device_ids()]
    if missing:
        raise FormatError(profile_file, f"has no device {', '.join(missing)}: profile these agents "
                                        "(edgeshard profile) or leave --profile out")
    width = run_prompt_tokens(model_dir, prompts) or 1
    problem = problem_from_profile(profile, checkpoint_model(model_dir),
                                   OffloadWorkload(prompt_tokens=width, generated_tokens=settings.max_new_tokens),
                                   devices=(*compute, *memory))
    in_flight = settings.micro_batches or 1
    plan = OffloadPlan(compute=tuple(compute), memory=tuple(memory), batch=-(-len(prompts) // in_flight),
                       in_flight=in_flight, schedule=schedule)
    technique = technique_named("attention-offload")
    return PlanOrigin(technique, problem, plan), technique.run_plan(plan, model_dir), width


def _wire(model_dir: str, memory: list[str], prompts: list[str], out, traffic, devices) -> dict:
    """The run's attention frames (``attend``/``attended``) as the agents' sockets sent them, beside the
    cost model's ``layer_wire_bytes`` (tensors and frame headers) for every layer of every forward the run
    made: per micro-batch of n rows and k steps, the prefill's n × prompt width positions, then k - 1 steps
    of n. Other frames (a staggered run's ``residual`` hand-overs) are in ``per_link_and_kind`` only."""
    from core.runs.generation import load_tokenizer
    from core.runs.wire import micro_batch_steps, wire_figures
    from core.techniques.attention_offload.cost import layer_wire_bytes
    from core.techniques.attention_offload.run import checkpoint_model

    model = checkpoint_model(model_dir)
    width = int(load_tokenizer(model_dir)(list(prompts), return_tensors="pt", padding=True)["input_ids"].shape[1])
    predicted = sum(model.layers * (layer_wire_bytes(model, rows * width, len(memory))
                                    + (steps - 1) * layer_wire_bytes(model, rows, len(memory)))
                    for rows, steps in micro_batch_steps(out.result.token_events).values())
    return wire_figures(traffic, devices, None, kinds=("attend", "attended"), predicted_total=predicted)
