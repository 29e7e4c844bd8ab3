"""`edgeshard` sub-commands for runtime: ``run``, ``agent serve``, ``cluster local``.

``run`` prints the generated text as it streams in, then TTFT, per-token latency and
tokens/s (the definitions of ``core.runs.metrics``), and can write every timeline event
and token event as JSON lines (``--events``). It records the run in the workspace (a new
session, through ``core.sessions.recording.record_run`` as the GUI's Run screen does), so it
is listed by ``edgeshard sessions`` and replays in the Sessions screen; ``--no-record`` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from agents.protocol import RUN_MODES, LinkShape, TimelineEvent, TokenEvent
from core.arguments import SEED, THREADS, TOKENS, add_image_arguments, add_penalty_arguments, float_in, int_in
from core.errors import DeployError, FormatError, RunFailed
from core.runs.speculative import speculate_k
from core.planning.plan import WEIGHT_PRECISIONS


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""
    _register_run(sub)
    _register_agent(sub)
    _register_cluster(sub)


# --------------------------------------------------------------------------- run
def add_weights_option(p) -> None:
    """``--weights`` and ``--torch-device`` (run and serve): every stage's weight precision, and where
    named stages compute, over the plan's own."""
    p.add_argument("--weights", choices=WEIGHT_PRECISIONS, default=None,
                   help="weight precision of every stage's blocks (weight-only int8/int4 quantized by the agents "
                        "at load; default: each stage's own in the plan, fp when it names none)")
    p.add_argument("--torch-device", type=_stage_torch_device, action="append", default=[], metavar="DEVICE=WHERE",
                   help="compute DEVICE's stage on WHERE: cpu, cuda or cuda:N (repeatable; default: the plan's "
                        "own per stage, cpu when it names none); a GPU the agent does not report is refused "
                        "before anything is loaded")


def _stage_torch_device(text: str) -> tuple[str, str]:
    """``DEVICE=WHERE`` of ``--torch-device``, WHERE checked here (one line, exit 2)."""
    from agents.accelerators import device_name_problem

    device, sep, where = text.partition("=")
    if not sep or not device:
        raise argparse.ArgumentTypeError(f"{text!r}: give DEVICE=WHERE, e.g. edge-b=cuda:0")
    if device_name_problem(where):
        raise argparse.ArgumentTypeError(f"{text!r}: {device_name_problem(where)}")
    return device, where


def plan_as_asked(plan, args):
    """``plan`` with ``--weights`` and ``--torch-device`` applied; a ``--torch-device`` naming a device
    the plan has no stage on is refused (a typo would otherwise run everything on the CPU)."""
    from core.planning.plan import with_torch_devices, with_weights

    asked = dict(args.torch_device)
    stray = sorted(set(asked) - set(plan.devices()))
    if stray:
        raise FormatError("--torch-device", f"the plan has no stage on {', '.join(stray)} "
                                            f"(its devices: {', '.join(plan.devices())})")
    return with_torch_devices(with_weights(plan, args.weights), asked)


def _register_run(sub) -> None:
    p = sub.add_parser("run", help="run a model split over agents and print the text as it is generated")
    p.add_argument("--model", help="checkpoint directory (HF layout; required for a language-model plan); the "
                   "agents get its absolute path, so remote agents need the checkpoint at that same path (or use "
                   "--send-weights)")
    p.add_argument("--send-weights", action="store_true",
                   help="send each agent only its stage's weights (checksummed, resumed, kept on the agent by "
                        "content hash: a plan change re-sends only what moved)")
    p.add_argument("--plan", required=True, help="plan JSON (edgeshard.plan)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--agents", help="agents.json (from `cluster local` or deploy), or "
                       "DEVICE=tcp://HOST:PORT@PUBKEY,... with --coordinator-key-file")
    where.add_argument("--local", action="store_true", help="start one loopback agent per plan stage for this run")
    p.add_argument("--coordinator-key-file", help="the coordinator keypair (with an address list in --agents)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", help="file with one prompt per line")
    p.add_argument("--max-new-tokens", type=TOKENS, default=32)
    p.add_argument("--mode", choices=RUN_MODES, default="sequential")
    p.add_argument("--micro-batches", type=int_in(0, 4096), default=None,  # 0: refused with the plan's count
                   help="override the plan's micro_batches (every mode; default: the plan's)")
    p.add_argument("--temperature", type=float_in(0, 100), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0)
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--repetition-penalty", type=float_in(0, 100, lo_open=True), default=1.0,
                   help="HF's repetition_penalty: > 1 discourages repeating a token the sequence holds (1 = off; "
                        "~1.2 stops greedy text looping); on, the last stage also receives the prompts' token ids")
    p.add_argument("--no-repeat-ngram-size", type=int_in(0, 64), default=0,
                   help="HF's no_repeat_ngram_size: never repeat an n-gram of this size (0 = off)")
    add_penalty_arguments(p, "")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_weights_option(p)
    p.add_argument("--threads", type=THREADS, default=0, help="torch threads per agent (0 = agent default)")
    p.add_argument("--link-mbit", type=float_in(0, 1e6), default=0.0, help="with --local: emulated bandwidth per link")
    p.add_argument("--link-latency-ms", type=float_in(0, 60_000), default=0.0, help="with --local: emulated latency per link")
    p.add_argument("--on-failure", choices=("stop", "replan"), default="stop",
                   help="when an agent is lost mid-run: stop (default: the run fails naming it) or replan "
                        "(re-plan over the survivors with the plan's technique's planner: layer sharding's exact solver, "
                        "expert offloading's with its buffer; reload, resume with the same tokens; "
                        "needs --problem)")
    p.add_argument("--problem", help="the planning problem (edgeshard.problem) the plan was solved for, or the "
                                     "profile (edgeshard.profile) it was planned from; --on-failure replan re-plans "
                                     "with it")
    p.add_argument("--origin", nargs=2, metavar=("PROBLEM", "PLAN"), help="the technique's own problem and plan "
                   "--plan was made from (e.g. the expert-offload plan given to moe configure --run-plan, and its "
                   "problem): recorded with the run, so its replay in Sessions draws the technique's prediction "
                   "(refused with --no-record)")
    p.add_argument("--draft", metavar="DIR", help="speculate: a draft checkpoint sharing the model's tokenizer "
                   "proposes --speculate tokens a trip, the stages verify them at once (one prompt; greedy, or "
                   "seeded speculative sampling with --temperature)")
    p.add_argument("--speculate", type=speculate_k, default=None, metavar="K|auto",
                   help="with --draft: tokens a trip (default 3), or auto: the cost model's k for this plan (or plain "
                        "decoding) from --problem and the draft's stored acceptance rate")
    p.add_argument("--draft-device", metavar="NAME", default=None,
                   help="with --draft: the plan's stage device that runs the draft (default: the source; auto picks "
                        "it by the cost model, counting the hops to it and back)")
    p.add_argument("--events", help="write timeline and token events to this JSONL file")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end: every sequence's token "
                   "ids and text (a CNN plan: every image's class and scores), the figures, the recorded run")
    add_image_arguments(p)
    p.add_argument("--workspace", metavar="FILE", help="record the run in this workspace file (default: "
                   "$EDGESHARD_WORKSPACE or ~/.local/share/edgeshard/workspace.sqlite)")
    p.add_argument("--no-record", action="store_true", help="do not record the run in the workspace")
    p.set_defaults(func=cmd_run)


class _PrintSink:
    """Prints text pieces of the first sequence as they arrive (others at the end; nothing with
    ``--json``, which prints one object at the end) and appends every event to a JSONL file."""

    def __init__(self, n_prompts: int, events_path: str | None, quiet: bool = False) -> None:
        from core.runs.run_stream import EventsFile

        self.n, self.quiet = n_prompts, quiet
        self._lock = threading.Lock()
        self._file = EventsFile(events_path) if events_path else None

    def on_event(self, event: TimelineEvent) -> None:
        if self._file is not None:
            self._file.on_event(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        if self._file is not None:
            self._file.on_tokens(tokens)
        with self._lock:
            if self.n == 1 and tokens.text and not self.quiet:
                sys.stdout.write(tokens.text[0])
                sys.stdout.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _parse_agents(spec: str, key_file: str | None):
    from agents.transport import CurveKeys, is_z85_key
    from core.runs.coordinator import AgentEndpoint
    from core.devices.local_cluster import load_agents_file

    if os.path.exists(spec):
        return load_agents_file(spec)
    if not key_file:
        raise FormatError("--agents", "not a file; an address list needs --coordinator-key-file")
    endpoints = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            device, rest = item.split("=", 1)
            address, key = rest.rsplit("@", 1)
        except ValueError:
            raise FormatError("--agents", f"{item!r} is not DEVICE=tcp://HOST:PORT@PUBKEY") from None
        if not address.startswith("tcp://") or not is_z85_key(key):
            raise FormatError("--agents", f"{item!r}: need a tcp:// address and a 40-char Z85 public key")
        endpoints.append(AgentEndpoint(device, address, key))
    try:
        keys = CurveKeys.load(key_file)
    except (OSError, ValueError) as err:
        raise FormatError(key_file, f"cannot read the coordinator key ({err})") from None
    return endpoints, keys


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts:
        try:
            prompts += [line.rstrip("\n") for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        except OSError as err:
            raise FormatError(args.prompts, f"cannot read file ({err.strerror or err})") from None
    if not prompts:
        raise FormatError("edgeshard run", "give --prompt TEXT or --prompts FILE")
    if not all(prompts):  # it would encode to no tokens: found only once the agents were up
        raise FormatError("--prompt", f"prompt {prompts.index('')} is empty: give some text")
    return prompts


def cmd_run(args) -> int:
    from core import formats
    from core.planning.plan import ShardPlan

    if args.origin and args.no_record:  # --origin is only recorded: with --no-record it would go unread
        raise FormatError("--origin", "given with --no-record, which records nothing (the origin is only "
                                      "recorded with the run): drop one of them")
    fmt = formats.format_of(args.plan)
    if fmt != "edgeshard.plan":  # not a shard plan: a technique's own (a spatial CNN plan)?
        from core.techniques import technique_for_plan_format

        technique = technique_for_plan_format(fmt)
        if technique is not None:  # its own run
            return technique.run_plan_file(args, None if args.local else _parse_agents(args.agents,
                                                                                     args.coordinator_key_file))
    if args.model and Path(args.model, "config.json").exists():  # a bad layout: one line before the run's imports
        _check_layout(formats.load(args.plan, ShardPlan), args.model)
    from core.reporting import TerminalReporter
    from core.runs.batching import batching_settings, micro_batch_count
    from core.runs.coordinator import FanoutSink
    from core.runs.generation import GenerationSettings, check_run, generation_json
    from core.runs.speculative import speculative_entrance
    from core.runs.prediction import run_prompt_tokens
    from core.sessions.recording import add_run_figures, record_run
    from core.sessions.store import default_workspace_path
    from core.techniques.run_origin import recorded_origin

    if not args.model:
        raise FormatError("edgeshard run", "give --model CHECKPOINT_DIR: the plan is a language model's")
    if args.image or args.images is not None:
        raise FormatError("edgeshard run", "--image / --images are for a CNN plan (edgeshard.spatial-plan); "
                                           "this plan is a language model's: give --prompt")
    plan = plan_as_asked(formats.load(args.plan, ShardPlan), args)
    prompts = _read_prompts(args)
    replan = _replanner(args, plan, len(prompts))
    origin = _origin(args.origin, plan) if args.origin else None
    k = micro_batch_count(plan, args.micro_batches)
    if args.micro_batches is not None and k > len(prompts):  # a micro-batch holds one prompt or more
        raise FormatError("--micro-batches", f"{k} micro-batches for {len(prompts)} prompt(s): give at least {k} "
                          f"prompts, or --micro-batches {len(prompts)} or less")
    if not Path(args.model, "config.json").exists():
        raise FormatError(args.model, "not a checkpoint directory (no config.json)")
    # agents resolve paths in their own directory: send the absolute path (remote agents need the
    # checkpoint at that same path; an agent without it answers with an error naming itself and the path)
    model_dir = os.path.abspath(args.model)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        mode=args.mode,
        micro_batches=args.micro_batches,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        dtype=args.dtype,
        threads=args.threads,
        send_weights=args.send_weights,
    )
    check_run(plan, model_dir, prompts, settings)  # before any agent is started or connected
    args.speculative = speculative_entrance(model_dir, args.draft, args.speculate, prompts, settings, plan,
                                            lambda: _problem_of(args, plan, len(prompts), "--speculate auto"),
                                            args.draft_device)
    agents = None if args.local else _parse_agents(args.agents, args.coordinator_key_file)
    if agents is not None:
        _check_agents_serve(plan.devices(), agents[0], args.agents)
    reporter = TerminalReporter()
    workspace = None if args.no_record else (args.workspace or default_workspace_path())
    recording = nullcontext() if workspace is None else record_run(
        workspace, model=Path(model_dir).name, mode=settings.mode,
        settings={"model_dir": model_dir, "prompts": prompts, "max_new_tokens": settings.max_new_tokens,
                  "mode": settings.mode,
                  "temperature": settings.temperature, "top_p": settings.top_p, "seed": settings.seed,
                  "repetition_penalty": settings.repetition_penalty,
                  "no_repeat_ngram_size": settings.no_repeat_ngram_size,
                  "frequency_penalty": settings.frequency_penalty, "presence_penalty": settings.presence_penalty,
                  "dtype": settings.dtype, "lanes": list(plan.devices()), "started_by": "edgeshard run",
                  **batching_settings(plan, args.micro_batches),
                  **({"prompt_tokens": run_prompt_tokens(model_dir, prompts)} if origin is not None else {})},
        session_name=f"edgeshard run {time.strftime('%Y-%m-%d %H:%M')}", plan=plan,
        origin=recorded_origin(origin) if origin is not None else None)
    printer = _PrintSink(len(prompts), args.events, quiet=args.json)
    try:
        with recording as run:
            sink = printer if run is None else FanoutSink(printer, run.recorder)
            try:
                out, meter = _generate(args, agents, plan, model_dir, prompts, settings, sink, reporter, replan)
            except KeyboardInterrupt:
                if run is not None:
                    run.status = "stopped"
                raise
            if run is not None:
                run.status = "completed"
                run.final_plan = out.result.plan if out.result.recoveries else None
        from core.runs.wire import layer_sharding_wire

        wire = layer_sharding_wire(model_dir, settings.dtype, prompts, out.result, meter, plan,
                                   speculative=args.speculative is not None)
        if run is not None:
            add_run_figures(workspace, run.run_id, {"wire": wire})
    finally:
        printer.close()
    if args.json:
        print(json.dumps({**generation_json(out, run.run_id if run is not None else None, settings.mode),
                          "wire": wire}))
        return 0
    if len(prompts) == 1:
        print()
    else:
        for i, (p, t) in enumerate(zip(prompts, out.texts)):
            print(f"[{i}] {p}{t}")
    f = out.figures
    ms = lambda v: "n/a" if v is None else f"{v * 1e3:.1f} ms"  # noqa: E731
    tps = "n/a" if f.tokens_per_s is None else f"{f.tokens_per_s:.1f}"
    dtps = "n/a" if f.decode_tokens_per_s is None else f"{f.decode_tokens_per_s:.1f}"
    print(f"TTFT {ms(f.ttft_s)}  per-token latency {ms(f.per_token_latency_s)}  "
          f"tokens/s {tps} (decode {dtps})  tokens {f.tokens}  mode {settings.mode}  "
          f"micro-batches {min(k, len(prompts))} ({'--micro-batches' if args.micro_batches is not None else 'the plan'})")
    if wire["measured_bytes"] is not None:
        print(f"wire: {wire['measured_bytes']} bytes between agents (the cost model: {wire['predicted_bytes']}, "
              f"x{wire['measured_over_predicted']}), {wire['control_bytes']} to the coordinator")
    after = wire.get("after_replan")
    if after is not None and after["measured_bytes"] is not None:
        print(f"wire after the re-plan: {after['measured_bytes']} bytes (the re-planned plan's cost model: "
              f"{after['predicted_bytes']}, x{after['measured_over_predicted']})")
    for r in out.result.recoveries:
        print(f"recovered: {r.failed} lost at step {r.step}, detected at {r.detected_s:.2f} s, re-planned in "
              f"{(r.replanned_s - r.detected_s) * 1e3:.0f} ms, shards loaded in {r.loaded_s - r.replanned_s:.2f} s; "
              f"stages {' -> '.join(r.old_stages)} became {' -> '.join(r.new_stages)}")
    if run is not None:
        print(f"recorded as run {run.run_id} (session {run.session_id}) in {workspace}")
    return 0


def _check_layout(plan, model_dir: str) -> None:
    """The plan's layout against the checkpoint's unit count (config.json alone), before the run's
    heavier imports (the coordinator, numpy, zmq: a second under load): what ``check_run`` checks first."""
    from core.errors import PlanInvalid
    from core.models.units import load_model_spec
    from core.planning.plan import layout_problems

    problems = layout_problems(plan, load_model_spec(model_dir).num_units)
    if problems:
        raise PlanInvalid(problems)


def check_plan_agents_answer(plan, agents, source: str) -> None:
    """Every plan device has an agent in ``source`` and it answers (``AgentLink.answering``: a killed one is
    named at once): a command's first contact, before its tokenizer, model or run imports."""
    from core.devices.agent_link import AgentLink

    endpoints, keys = agents
    _check_agents_serve(plan.devices(), endpoints, source)
    with AgentLink([e for e in endpoints if e.device in plan.devices()], keys) as link:
        link.answering(plan.devices())


def _check_agents_serve(devices, endpoints, source: str) -> None:
    """Every device the plan names has an agent in ``source``: checked before connecting to any."""
    from core.errors import PlanInvalid

    known = {e.device for e in endpoints}
    missing = [d for d in devices if d not in known]
    if missing:
        raise PlanInvalid([f"the plan runs stages on {', '.join(missing)}, which {source} does not list "
                           f"(it lists {', '.join(sorted(known)) or 'no agent'})"])


def _replanner(args, plan, prompts: int):
    """The exact re-planner of ``--on-failure replan`` (None for ``stop``); checked before any work.
    ``--problem`` is the planning problem the plan was solved for, or the profile it was planned from
    (made into a problem here: the plan's first device holds the prompts, this run's workload)."""
    from core.techniques import replanner_for

    if args.on_failure == "stop":
        return None
    return replanner_for(plan, _problem_of(args, plan, prompts, "--on-failure replan"), os.path.abspath(args.model))


def _origin(files: list[str], plan):
    """``--origin PROBLEM PLAN`` read as ``plan``'s technique's own problem and plan (the Run screen's
    ``PlanOrigin``), or a one-line error naming the file (another technique's, or not a problem/plan)."""
    from core import formats
    from core.runs.prediction import PlanOrigin
    from core.techniques import technique_named, technique_of_plan

    technique = technique_named(technique_of_plan(plan))
    if technique.problem_type is None or technique.plan_type is None:
        raise FormatError("--origin", f"{technique.title} records no origin")
    return PlanOrigin(technique, formats.load(files[0], technique.problem_type),
                      formats.load(files[1], technique.plan_type))


def _problem_of(args, plan, prompts: int, needed_by: str):
    """``--problem``'s planning problem for ``plan`` (a profile made into one), or a one-line error."""
    from core.cli.planning import load_problems

    if not args.problem:
        raise FormatError(needed_by, "needs --problem FILE (the planning problem the plan was solved "
                          "for, or the profile.json it was planned from)")
    problems = load_problems(argparse.Namespace(
        file=args.problem, problem=None, source=plan.stages[0].device if plan.stages else None, prompt_tokens=None,
        generated_tokens=args.max_new_tokens, batch=prompts))
    if len(problems) != 1:
        raise FormatError(args.problem, f"holds {len(problems)} problems: give the problem or the profile the plan "
                                        "was made from")
    problem = problems[0]
    if problem.profile.model.name != plan.model:
        raise FormatError(args.problem, f"is for model {problem.profile.model.name!r}, the plan for {plan.model!r}",
                          "profile.model")
    return problem


def _generate(args, agents, plan, model_dir: str, prompts: list[str], settings, sink, reporter, replan=None):
    """Connect to ``agents`` (endpoints, keys), or start local ones for this run, and generate."""
    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator
    from core.runs.generation import generate
    from core.runs.wire import WireMeter

    cluster = tmp = None
    try:
        if args.local:
            tmp = tempfile.TemporaryDirectory(prefix="edgeshard-local-")
            threads = args.threads or max(1, (os.cpu_count() or 1) // len(plan.stages))
            cluster = LocalCluster(tmp.name, list(plan.devices()), threads_per_agent=threads,
                                   link_mbit=args.link_mbit, link_latency_ms=args.link_latency_ms)
            reporter.status(f"starting {len(plan.stages)} local agents")
            endpoints, keys = cluster.start(), cluster.keys
        else:
            endpoints, keys = agents
        with Coordinator(endpoints, keys) as coordinator:
            if not args.local:  # a dead agent of the plan: named at once, before the model is loaded here
                coordinator.link.answering(plan.devices())
            with WireMeter(coordinator, plan.devices()) as meter:
                if getattr(args, "speculative", None) is not None:
                    from core.runs.speculative import generate_speculative

                    out = generate_speculative(coordinator, plan, model_dir, prompts[0], settings, args.speculative,
                                               sink=sink, reporter=reporter)
                else:
                    out = generate(coordinator, plan, model_dir, prompts, settings, sink=sink, reporter=reporter,
                                   replan=replan)
        return out, meter
    finally:
        if cluster is not None:
            cluster.stop()
        if tmp is not None:
            tmp.cleanup()


# ------------------------------------------------------------------------- agent
def _register_agent(sub) -> None:
    from agents.__main__ import add_serve_arguments

    p = sub.add_parser("agent", help="run this machine's agent")
    asub = p.add_subparsers(dest="agent_command", metavar="ACTION")
    s = asub.add_parser("serve", help="serve the control and data sockets (what deploy starts)")
    add_serve_arguments(s)
    s.set_defaults(func=_cmd_agent_serve)


def _cmd_agent_serve(args) -> int:
    from agents.__main__ import serve

    return serve(args)


# ----------------------------------------------------------------------- cluster
def _register_cluster(sub) -> None:
    p = sub.add_parser("cluster", help="development clusters")
    csub = p.add_subparsers(dest="cluster_command", metavar="KIND")
    s = csub.add_parser("local", help="N agents on loopback (no root); Ctrl-C stops them all")
    s.add_argument("-n", "--agents", type=int_in(1, 64), default=4, dest="n")
    s.add_argument("--dir", default=None, help="working directory (keys, logs, agents.json); default a temp dir")
    s.add_argument("--names", default=None, help="comma-separated device names (default local-0..)")
    s.add_argument("--threads", type=THREADS, default=1, help="torch threads per agent")
    s.add_argument("--link-mbit", default="0", help="emulated bandwidth of each agent's outgoing link "
                   "(one value, or one per agent: 200,100,50)")
    s.add_argument("--link-latency-ms", default="0", help="emulated added latency per message (one or per agent)")
    s.add_argument("--memory-mib", default=None, help="emulated memory budget per agent, enforced on shard "
                   "weights (one value, or one per agent: 24,16,12)")
    s.add_argument("--slowdown", default=None, help="emulated compute slowdown per agent, >= 1 (one or per agent)")
    s.add_argument("--restart", action="store_true", help="start an agent that exits again, on its ports and key "
                   "(coordinators reach it where they did)")
    s.add_argument("--launcher", choices=("zygote", "popen"), default=None,
                   help="zygote: fork every agent from one process that imported torch once (default, falls back "
                        "to popen if it cannot start); popen: each agent its own interpreter "
                        "(default from $EDGESHARD_AGENT_LAUNCHER)")
    s.set_defaults(func=cmd_cluster_local)


def cmd_cluster_local(args) -> int:
    from core.devices.local_cluster import LocalCluster, emulations_from_flags, per_agent_values

    if args.n < 1:
        raise FormatError("-n", "need at least one agent")
    names = [s.strip() for s in args.names.split(",")] if args.names else [f"local-{i}" for i in range(args.n)]
    if len(names) != args.n:
        raise FormatError("--names", f"{len(names)} names for {args.n} agents")
    if not all(names) or len(set(names)) != len(names):
        raise FormatError("--names", f"each agent needs its own non-empty name, got {args.names!r}")
    if args.dir and os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise FormatError(args.dir, "is a file: give a folder for the keys, logs and agents.json", "--dir")
    mbit = dict(zip(names, per_agent_values(args.link_mbit, args.n, "--link-mbit")))
    latency = dict(zip(names, per_agent_values(args.link_latency_ms, args.n, "--link-latency-ms")))
    emulation = emulations_from_flags(names, args.memory_mib, args.slowdown)
    tmp = None
    workdir = args.dir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="edgeshard-cluster-")
        workdir = tmp.name
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(workdir, names, threads_per_agent=args.threads, link_mbit=mbit,
                           link_latency_ms=latency, emulation=emulation, launcher=args.launcher)
    try:
        endpoints = cluster.start()
        print(cluster.launch_note, flush=True)
        for e in endpoints:
            link = (f", link {mbit[e.device] or '∞'} Mbit/s + {latency[e.device]:g} ms"
                    if mbit[e.device] or latency[e.device] else "")
            print(f"{e.device}  {e.control_address}  {e.public_key}  ({emulation[e.device].describe()}{link})")
        print(f"{len(endpoints)} agents up. Agents file: {cluster.agents_file}")
        print("Press Ctrl-C to stop.", flush=True)
        reported: set[str] = set()
        while not stop.wait(1.0):
            for device, code in cluster.exited():  # one agent's death is reported, the others stay up
                if device in reported:
                    continue
                if args.restart:
                    print(f"edgeshard: agent {device} exited (status {code}); restarting it", file=sys.stderr,
                          flush=True)
                    try:
                        e = cluster.restart(device)
                    except DeployError as err:
                        print(f"edgeshard: {err}", file=sys.stderr, flush=True)
                        reported.add(device)
                        continue
                    print(f"{e.device}  {e.control_address}  {e.public_key}  (restarted)", flush=True)
                else:
                    reported.add(device)
                    print(f"edgeshard: agent {device} exited (status {code}); the other agents stay up",
                          file=sys.stderr, flush=True)
            if len(reported) == len(cluster.devices):
                raise RunFailed("every local agent exited")
    finally:
        cluster.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        if tmp is not None:
            tmp.cleanup()
        print("cluster stopped", flush=True)
    return 0
