"""`edgeshard serve`: the cluster behind an OpenAI-compatible HTTP endpoint (docs/serving.md).

Every argument and file is checked at the entrance (plan, checkpoint, tokenizer, key file,
workspace, the address to listen on) before any agent starts; then the plan is loaded once
and requests are served until SIGINT or SIGTERM: the server stops accepting, lets in-flight
requests finish for ``--shutdown-grace-s`` seconds and cancels what is left, unloads the plan,
stops the agents it started and exits 0. It listens on loopback unless told otherwise, and
refuses any other address without ``--api-key-file``: a cluster reachable from the network
with no key would serve anyone.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from agents.protocol import RUN_MODES
from core.arguments import SEED, THREADS, TOKENS, add_penalty_arguments, float_in, int_in
from core.cli.runs import add_weights_option
from core.errors import FormatError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a plan's model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    p.add_argument("--plan", required=True, help="plan JSON (edgeshard.plan)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--agents", help="agents.json (from `cluster local` or deploy), or "
                       "DEVICE=tcp://HOST:PORT@PUBKEY,... with --coordinator-key-file")
    where.add_argument("--local", action="store_true", help="start one loopback agent per plan stage")
    p.add_argument("--coordinator-key-file", help="the coordinator keypair (with an address list in --agents)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; any other "
                   "needs --api-key-file)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="port (0: a free one, printed)")
    p.add_argument("--api-key-file", help="file holding the API key clients send as 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", help="the model id clients name (default: the checkpoint folder's name)")
    p.add_argument("--max-new-tokens", type=TOKENS, default=256,
                   help="a request's max_tokens when it gives none (capped by the context left)")
    p.add_argument("--mode", choices=RUN_MODES, default="no-bubbles",
                   help="how the open run's micro-batches share the stages (default no-bubbles: a request joins "
                        "at once, between the others' steps)")
    p.add_argument("--micro-batches", type=int_in(1, 4096), default=None,
                   help="override the plan's micro_batches (default: the plan's)")
    p.add_argument("--temperature", type=float_in(0, 2), default=0.0,
                   help="a request's temperature when it gives none (0 = greedy)")
    p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0)
    p.add_argument("--seed", type=SEED, default=None,
                   help="a sampled request's seed when it gives none (default: a new one per request, recorded)")
    p.add_argument("--repetition-penalty", type=float_in(0, 100, lo_open=True), default=1.0,
                   help="HF's repetition_penalty when a request gives none (1 = off)")
    p.add_argument("--no-repeat-ngram-size", type=int_in(0, 64), default=0,
                   help="HF's no_repeat_ngram_size when a request gives none (0 = off)")
    add_penalty_arguments(p, " when a request gives none")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_weights_option(p)
    p.add_argument("--threads", type=THREADS, default=0, help="torch threads per agent (0 = agent default)")
    p.add_argument("--send-weights", action="store_true", help="send each agent only its stage's weights")
    p.add_argument("--local-cpus", choices=("split", "shared"), default=None,
                   help="with --local: split (default) puts the agents on the cores the micro-batches in flight "
                        "need and the server on the others while that leaves it some; shared runs every process "
                        "on every core")
    p.add_argument("--on-failure", choices=("stop", "replan"), default="stop",
                   help="an agent lost mid-request: stop (its requests get 503; the plan is loaded again for the "
                        "next request) or replan (re-plan over the survivors and resume; needs --problem)")
    p.add_argument("--problem", help="the planning problem the plan was solved for (--on-failure replan)")
    p.add_argument("--max-batch", type=int_in(1, 256), default=16, help="most requests one run serves")
    p.add_argument("--max-queue", type=int_in(1, 100_000), default=64,
                   help="most requests waiting for a run; more get 429 with Retry-After")
    p.add_argument("--batch-window-ms", type=float_in(0, 10_000), default=0.0,
                   help="how long an idle cluster waits for more requests to batch with the first")
    p.add_argument("--max-body-bytes", type=int_in(1024, 1 << 30), default=1 << 20)
    p.add_argument("--shutdown-grace-s", type=float_in(0, 600), default=5.0,
                   help="on SIGINT/SIGTERM, how long in-flight requests may finish before they are cancelled")
    p.add_argument("--workspace", metavar="FILE", help="record every request as a run in this workspace file "
                   "(default: $EDGESHARD_WORKSPACE or ~/.local/share/edgeshard/workspace.sqlite)")
    p.add_argument("--no-record", action="store_true", help="do not record requests")
    p.set_defaults(func=cmd_serve)


def _read_key(path: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise FormatError(path, f"cannot read the API key file ({getattr(err, 'strerror', None) or err})") from None
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise FormatError(path, "the API key file must hold one key: printable characters, no spaces")
    return key


def cmd_serve(args) -> int:
    from core import formats
    from core.cli.runs import _parse_agents, _replanner, plan_as_asked
    from core.models.checkpoints import check_model_dir
    from core.planning.plan import ShardPlan
    from core.runs.generation import GenerationSettings, check_run, load_tokenizer
    from core.serving import bind, is_loopback
    from core.sessions.store import SessionStore, default_workspace_path
    from core.techniques import generation_for, technique_for_plan_format

    if technique_for_plan_format(formats.format_of(args.plan)) is not None:
        raise FormatError(args.plan, "serve runs a language model's plan (edgeshard.plan), not a technique's own "
                                     "plan format")
    key = _read_key(args.api_key_file) if args.api_key_file else None
    if key is None and not is_loopback(args.host):
        raise FormatError("--host", f"refusing to serve on {args.host} without --api-key-file: anyone who reaches "
                                    "that address could use the cluster (give a key file, or bind 127.0.0.1)")
    plan = plan_as_asked(formats.load(args.plan, ShardPlan), args)
    if not Path(args.model, "config.json").exists():
        raise FormatError(args.model, "not a checkpoint directory (no config.json)")
    model_dir = os.path.abspath(args.model)
    settings = GenerationSettings(mode=args.mode, micro_batches=args.micro_batches, dtype=args.dtype,
                                  threads=args.threads, send_weights=args.send_weights)
    check_run(plan, model_dir, ("(the requests)",), settings)  # the plan against the checkpoint, the settings
    if generation_for(plan) is not None:
        raise FormatError(args.plan, "this plan's stages run through their technique's own driver, which serve "
                                     "does not drive yet; serve a layer-sharded plan")
    if args.local_cpus is not None and not args.local:
        raise FormatError("--local-cpus", "places the agents --local starts; agents of --agents run where they were "
                                          "started (leave --local-cpus out, or serve with --local)")
    replan = _replanner(args, plan, args.max_batch)  # the workload a re-plan solves for: a full micro-batch
    agents = None if args.local else _parse_agents(args.agents, args.coordinator_key_file)
    if agents is not None:  # a dead agent of the plan: named at once, before the tokenizer and the model load
        from core.cli.runs import check_plan_agents_answer

        check_plan_agents_answer(plan, agents, args.agents)
    check_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    store = None if args.no_record else SessionStore(args.workspace or default_workspace_path())
    sock = None
    try:
        sock = bind(args.host, args.port)
        return _serve(args, agents, plan, model_dir, tokenizer, settings, replan, store, key, sock)
    finally:
        if sock is not None:
            sock.close()
        if store is not None:
            store.close()


SERVE_LEASE_S = 10.0
"""How long agents keep the server's open run without hearing from it. The open run lasts as long as
the server: a loaded server process (32 streaming clients at load 18 in the soak) went 3 s (the
default lease) without a heartbeat out, and the agents aborted the run under 10 of its requests."""


def freeze_heap() -> None:
    """What the server holds once it serves (torch, transformers, the tokenizer, the loaded plan: ~315,000 objects)
    is moved out of the collector's reach: a full collection walked it all, ~150 ms of CPU holding the GIL (the
    event loop and the coordinator's IO thread paused), about every 20 s at 16 streams on 3 stages: ~9 µs of
    the server's CPU per token (docs/serving.md, Measured). Only in ``edgeshard serve``'s own process: the
    studio's collections run on its GUI thread (``gui.widgets.gui_thread_collector``)."""
    gc.collect()
    gc.freeze()


def _serve(args, agents, plan, model_dir, tokenizer, settings, replan, store, key, sock) -> int:
    from core.devices.local_cluster import LocalCluster
    from core.reporting import TerminalReporter
    from core.runs.coordinator import Coordinator
    from core.runs.batching import micro_batch_count
    from core.serving import Defaults, EndpointLimits, ServedModel, ServeSettings, ServingEndpoint

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    reporter = TerminalReporter()
    cluster = tmp = placer = None
    name = args.served_model_name or Path(model_dir).name
    try:
        if args.local:
            tmp = tempfile.TemporaryDirectory(prefix="edgeshard-serve-")
            threads = args.threads or max(1, len(os.sched_getaffinity(0)) // len(plan.stages))  # the cores it may use
            cluster = LocalCluster(tmp.name, list(plan.devices()), threads_per_agent=threads)
            reporter.status(f"starting {len(plan.stages)} local agents")
            endpoints, keys = cluster.start(), cluster.keys
        else:
            endpoints, keys = agents
        with Coordinator(endpoints, keys, lease_s=SERVE_LEASE_S) as coordinator:
            session_id = None if store is None else store.create_session(
                f"edgeshard serve {time.strftime('%Y-%m-%d %H:%M')}")
            served = ServedModel(coordinator, plan, model_dir, name, tokenizer,
                                 ServeSettings(generation=settings, max_tokens=args.max_new_tokens),
                                 replan=replan, store=store, session_id=session_id)
            served.load(reporter)
            if cluster is not None and args.local_cpus != "shared":
                from core.devices.cpu_placement import CpuPlacer

                placer = CpuPlacer(cluster.live_pids, threads)
                served.on_busy = placer.on_busy
                placer.place(0)  # the first request's stages already on theirs
            defaults = Defaults(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, repetition_penalty=args.repetition_penalty,
                                no_repeat_ngram_size=args.no_repeat_ngram_size,
                                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
            limits = EndpointLimits(max_queue=args.max_queue, max_batch=args.max_batch,
                                    batch_window_s=args.batch_window_ms / 1e3, max_body_bytes=args.max_body_bytes,
                                    shutdown_grace_s=args.shutdown_grace_s, defaults=defaults)
            endpoint = ServingEndpoint(served, sock, key=key, limits=limits,
                                       spread=micro_batch_count(plan, args.micro_batches))
            try:
                endpoint.start()
                freeze_heap()
                host = f"[{args.host}]" if ":" in args.host else args.host
                print(f"edgeshard serve: http://{host}:{endpoint.port}/v1 serves {name!r} on {len(plan.stages)} "
                      f"stage(s) ({settings.mode}){', key required' if key else ''}; Ctrl-C stops", flush=True)
                while not stop.wait(0.5) and endpoint.http.alive:
                    pass
            finally:
                endpoint.stop()
            if not stop.is_set():
                print("edgeshard serve: error: the HTTP server stopped by itself (see the log above)",
                      file=sys.stderr, flush=True)
                return 1
            print(f"edgeshard serve: stopped after {endpoint.queue.served} request(s)", flush=True)
    finally:
        if placer is not None:
            placer.close()
        if cluster is not None:
            cluster.stop()
        if tmp is not None:
            tmp.cleanup()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0
