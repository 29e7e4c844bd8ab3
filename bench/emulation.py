"""The emulated compute slowdown on the demo's cluster, measured against its prediction; prints one JSON line.

The demo's three agents (``gui.demo``: edge-a 1×, edge-b 1.5×, edge-c 8× slower, their memory
budgets and links) on a local cluster, the demo recipe's checkpoint (untrained: the same units and
sizes), profiled by each cluster's agents; then per round, on each cluster:

- layer sharding, the exact minimum-latency plan (three stages, as the demo's Auto-solve): a
  ``sequential`` run of one prompt — per-token time (median gap between tokens) against the
  simulator's, and each stage's decode compute (median of its ``compute`` events) against the
  profile's × the slowdown (``cost.stage_compute_s``); a ``no-bubbles`` run of the demo's two
  micro-batches (``DEMO_RUN_MODE``, with the demo's repetition penalty) — steady tokens/s (second
  half) against the simulator's, each stage's compute while pipelined (two stages compute at once
  on the shared cores), and the two ms/token a presenter compares: the Plan screen's prediction
  (``cost.evaluate``) and the Run screen's measured one (``metrics.per_token_latency_s``);
- attention offloading as the demo runs it (edge-c computes, edge-a and edge-b hold the KV
  cache): per-token time (no prediction: its simulator needs a calibration this bench does not make).

``--agents-from DIR``: a second cluster whose agents import ``agents/`` from DIR (a checkout of
another commit: ``git worktree add DIR COMMIT``), alive beside this tree's and run in turn with it
round by round (the order alternates), on the same plan: an A/B of the agent code under the same
load, each cluster's predictions from its own agents' profile (the profiler ships with the agent).
``--busy N``: N processes spin on the host's cores during the rounds (after the profile),
neighbours whose load an emulated device should not feel. The 1-minute load average is read
before every run; each figure comes with the range its runs saw.

Usage: python bench/emulation.py [--rounds 3] [--new-tokens 24] [--agents-from DIR] [--busy 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

PROMPT_TOKENS = 8


def _cluster_class(path: str | None):
    """The local cluster whose agents import ``agents/`` from ``path`` (None: this tree's).

    Not by setting PYTHONPATH around the cluster's start: ``agents.zygote.agent_environment`` puts
    the launcher's own tree first in the agents' PYTHONPATH (so a checkout never starts another
    installed copy), and both clusters ran this tree's agents — the A/B compared a tree with itself."""
    from core.devices.local_cluster import LocalCluster

    if path is None:
        return LocalCluster

    class ClusterFrom(LocalCluster):
        def _agent_env(self) -> dict[str, str]:
            env = super()._agent_env()
            env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)  # no empty entry (= cwd)
            return env

    return ClusterFrom


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--agents-from", default="", help="a second cluster's agents import agents/ from this checkout")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the cores during the rounds")
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "emulation-demo-llama"))
    args = ap.parse_args()
    if args.rounds < 1 or args.new_tokens < 4 or args.busy < 0:
        ap.error("--rounds must be >= 1, --new-tokens >= 4 and --busy >= 0")
    if args.agents_from and not (Path(args.agents_from) / "agents" / "emulation.py").exists():
        ap.error(f"--agents-from {args.agents_from}: no agents/emulation.py there (a checkout of this repository)")

    import torch

    from agents.protocol import SamplingSpec
    from core.devices.profiling import profile_cluster
    from core.models.checkpoints import make_model
    from core.planning import cost
    from core.planning.problem import PlanningProblem, Workload
    from core.planning.solvers.exact import solve_min_latency
    from core.runs.coordinator import Coordinator, RunRequest
    from core.runs.metrics import median_step_gap_s, per_token_latency_s
    from core.runs.simulator import simulate
    from core.techniques.attention_offload.run import run_offload
    from gui.demo import DEMO_REPETITION_PENALTY, DEMO_RUN_MODE
    from gui.demo_cluster import DEMO_DEVICES, DEMO_LINK_LATENCY_MS, DEMO_PROFILE_OPTIONS, demo_emulation, demo_shape
    from gui.demo_model import demo_recipe

    started = time.perf_counter()
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        make_model(demo_recipe(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    devices = list(DEMO_DEVICES)
    emulation = demo_emulation(devices, model_dir)
    variants = {"this_tree": None}
    if args.agents_from:
        variants["agents_from"] = str(Path(args.agents_from).resolve())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(config["vocab_size"]), (2, PROMPT_TOKENS), generator=gen).tolist()

    def request(n: int, mode: str, micro_batches: int, sampling: SamplingSpec = SamplingSpec()) -> RunRequest:
        rows = tuple(tuple(r) for r in ids[:n])
        return RunRequest(input_ids=rows, attention_mask=tuple((1,) * PROMPT_TOKENS for _ in rows),
                          max_new_tokens=args.new_tokens, mode=mode, micro_batches=micro_batches, eos_token_ids=(),
                          sampling=sampling)

    mode, k = DEMO_RUN_MODE
    figures = {v: {"per_token_ms": [], "stage_ms": {}, "nobubbles_tok_s": [], "pipelined_stage_ms": {},
                   "offload_per_token_ms": [], "run_screen_ms": [], "load": []} for v in variants}
    with tempfile.TemporaryDirectory(prefix="edgeshard-emulation-") as tmp, ExitStack() as stack:
        coordinators = {}
        for v, path in variants.items():
            cluster = stack.enter_context(_cluster_class(path)(
                Path(tmp) / v, devices, threads_per_agent=1, emulation=emulation,
                link_mbit={d: demo_shape(d).link_mbit for d in devices}, link_latency_ms=DEMO_LINK_LATENCY_MS))
            co = coordinators[v] = stack.enter_context(Coordinator(cluster.endpoints, cluster.keys,
                                                                   request_timeout_s=60))
            co.sync_clocks()
        options = {key: val for key, val in DEMO_PROFILE_OPTIONS.items() if key != "link_target_s"}
        problems = {}
        for v in variants:  # each cluster profiled by its own agents: the predictions are each code's
            profile = profile_cluster(coordinators[v], config, model_name="demo", dtype="fp32",
                                      link_target_s=DEMO_PROFILE_OPTIONS["link_target_s"], threads=1, **options).profile
            problems[v] = PlanningProblem(name="emulation", profile=profile, source=devices[0],
                                          workload=Workload(prompt_tokens=PROMPT_TOKENS,
                                                            generated_tokens=args.new_tokens, batch_size=1))
        plan = solve_min_latency(problems["this_tree"]).plan  # one plan: both run the same stages
        for _ in range(args.busy):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            stack.callback(spinner.wait)
            stack.callback(spinner.kill)
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for v in order:
                co, f = coordinators[v], figures[v]
                co.load(plan, str(model_dir), threads=1)
                co.run(plan, request(1, "sequential", 1))  # warm-up
                f["load"].append(os.getloadavg()[0])
                res = co.run(plan, request(1, "sequential", 1))
                f["per_token_ms"].append(median_step_gap_s(res.token_events) * 1e3)
                _stage_medians(res.events, plan, f["stage_ms"])
                f["load"].append(os.getloadavg()[0])
                res = co.run(plan, request(k, mode, k, SamplingSpec(repetition_penalty=DEMO_REPETITION_PENALTY)))
                f["nobubbles_tok_s"].append(k / median_step_gap_s(res.token_events, second_half=True))
                f["run_screen_ms"].append(per_token_latency_s(res.token_events) * 1e3)
                _stage_medians(res.events, plan, f["pipelined_stage_ms"])
                f["load"].append(os.getloadavg()[0])
                res = run_offload(co, str(model_dir), devices[2], devices[:2], request(1, "sequential", 1))
                f["offload_per_token_ms"].append(median_step_gap_s(res.token_events) * 1e3)
    out = {}
    for v, f in figures.items():
        problem = problems[v]
        seq = simulate(problem, plan, "sequential")
        pipe = simulate(problem, plan, mode, micro_batches=k, micro_batch_size=1)
        pipe_tps = pipe.steady_tokens_per_s or pipe.figures.decode_tokens_per_s
        predicted_stage_ms = {f"{s.device} [{s.start},{s.end})": cost.stage_compute_s(
            problem.profile.times_of(s.device), s, "decode", 1) * 1e3 for s in plan.stages}
        per_token = statistics.median(f["per_token_ms"])
        tps = statistics.median(f["nobubbles_tok_s"])
        out[v] = {
            "load_1min": [round(min(f["load"]), 2), round(max(f["load"]), 2)],
            "per_token_ms": {"measured": round(per_token, 2), "predicted": round(seq.figures.per_token_latency_s * 1e3, 2),
                             "error": round(seq.figures.per_token_latency_s * 1e3 / per_token - 1, 3),
                             "rounds": [round(x, 2) for x in f["per_token_ms"]]},
            "stage_decode_compute_ms": {
                name: {"measured": round(statistics.median(xs), 3), "predicted": round(predicted_stage_ms[name], 3),
                       "measured_over_predicted": round(statistics.median(xs) / predicted_stage_ms[name], 2)}
                for name, xs in f["stage_ms"].items()},
            f"{mode}_{k}_tok_s": {"measured": round(tps, 2), "predicted": round(pipe_tps, 2),
                                  "error": round(pipe_tps / tps - 1, 3), "rounds": [round(x, 2) for x in f["nobubbles_tok_s"]]},
            "pipelined_stage_compute_over_predicted": {
                name: round(statistics.median(xs) / predicted_stage_ms[name], 2)
                for name, xs in f["pipelined_stage_ms"].items()},
            "demo_screens_ms_per_token": {
                "plan_screen_predicted": round(cost.evaluate(problem, plan).latency_per_token_s * 1e3, 2),
                "run_screen_measured": round(statistics.median(f["run_screen_ms"]), 2),
                "rounds": [round(x, 2) for x in f["run_screen_ms"]]},
            "attention_offload_per_token_ms": {"measured": round(statistics.median(f["offload_per_token_ms"]), 2),
                                               "rounds": [round(x, 2) for x in f["offload_per_token_ms"]]},
        }
    print(json.dumps({
        "bench": "emulation",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "model": f"demo recipe (llama {config['num_hidden_layers']} layers, hidden {config['hidden_size']}), fp32",
        "devices": {d: emulation[d].describe() for d in devices},
        "plan": [[s.device, s.start, s.end] for s in plan.stages],
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "agents_from": variants.get("agents_from"),
        "busy_processes": args.busy,
        "variants": out,
        "wall_s": round(time.perf_counter() - started, 1),
    }, ensure_ascii=False))


def _stage_medians(events, plan, into: dict) -> None:
    """Each stage's decode ``compute`` durations of one run, in ms, appended under its name."""
    for j, s in enumerate(plan.stages):
        durs = [e.duration_s * 1e3 for e in events if e.kind == "compute" and e.phase == "decode" and e.stage == j]
        if durs:
            into.setdefault(f"{s.device} [{s.start},{s.end})", []).append(statistics.median(durs))


if __name__ == "__main__":
    main()
