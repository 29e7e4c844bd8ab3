"""OpenMP's wait policy and torch threads per agent, side by side in one run; one JSON line.

The hypothesis (issue 14): torch's CPU wheel runs its intra-op pool on libgomp, whose worker
threads spin after a parallel region (``OMP_WAIT_POLICY`` unset: up to ``GOMP_SPINCOUNT``
iterations) — so with several agents of more than one torch thread on 2 cores, a stage that
just computed keeps burning a core while the next stage's receive needs it.

Each variant is its own local cluster (a solo agent and a 4-stage plan of the benchmark
Llama, ``bench/runtime.py``'s model and splits), started with its own environment and
torch thread count; the variants run in interleaved rounds so the machine's load drifts
over all alike. Per variant, medians over rounds: decode tokens/s of 1 and 4 stages, the
4-stage/1-stage ratio (wall and CPU per token), the hop (offset-free: token gap less the
stages' compute, 4 stages less 1, per hop), the compute per decode step (1 stage; 4 stages
summed), CPU ms per generated token (every thread of the agent processes).

The ``spin`` variants give libgomp's own default explicitly (``GOMP_SPINCOUNT=300000``, no
wait policy), so they mean the same whatever the agents' launch sets when nothing is set.

Usage: python bench/investigations/omp_wait.py [--model DIR] [--rounds 5] [--new-tokens 32]
       [--variants t1-spin,t1-passive,t2-spin,t2-passive]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import runtime as rt  # noqa: E402  (bench/runtime.py: the model, the splits and the figures' helpers)

LIBGOMP_DEFAULT_SPIN = "300000"  # libgomp's spin count when no wait policy is set (its env.c)

# name -> (torch threads per agent, environment of the agents; None removes the variable)
VARIANTS: dict[str, tuple[int, dict[str, str | None]]] = {
    "t1-spin": (1, {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN}),
    "t1-passive": (1, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
    "t2-spin": (2, {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN}),
    "t2-passive": (2, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
    "t2-spincount0": (2, {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "0"}),
    "t2-spin10k": (2, {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}),  # ≈ 0.1 ms (libgomp: ~1e5 spins/ms)
    "t2-active": (2, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
}


def _put(changes: dict[str, str | None]) -> None:
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def environment(changes: dict[str, str | None]):
    """``os.environ`` with ``changes`` while the cluster spawns its agents (they copy it)."""
    old = {k: os.environ.get(k) for k in changes}
    try:
        _put(changes)
        yield
    finally:
        _put(old)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--variants", default="t1-spin,t1-passive,t2-spin,t2-passive")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")

    import torch

    from agents.protocol import SamplingSpec
    from core.devices.local_cluster import LocalCluster
    from core.models.checkpoints import make_benchmark_model
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import Coordinator, RunRequest
    from core.runs.metrics import decode_tokens_per_s

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        make_benchmark_model(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    units = int(config["num_hidden_layers"]) + 2
    q = units // 4
    ids = torch.randint(3, int(config["vocab_size"]), (1, rt.PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    request = RunRequest(input_ids=tuple(map(tuple, ids.tolist())), attention_mask=((1,) * rt.PROMPT_TOKENS,),
                         max_new_tokens=args.new_tokens, mode="sequential", micro_batches=1, eos_token_ids=(),
                         sampling=SamplingSpec())

    fig: dict[str, dict[str, list[float]]] = {
        n: {k: [] for k in ("tok_s_1", "tok_s_4", "cpu_1", "cpu_4", "over_1", "over_4", "comp_1", "comp_4")}
        for n in names}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="edgeshard-omp-") as tmp, contextlib.ExitStack() as stack:
        setups = {}
        for n in names:
            threads, env = VARIANTS[n]
            devs = [f"{n}-solo"] + [f"{n}-{i}" for i in range(4)]
            with environment(env):
                cluster = stack.enter_context(LocalCluster(Path(tmp) / n, devs, threads_per_agent=threads))
            co = stack.enter_context(Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=120))
            plans = {"1": plan_from_boundaries("bench", units, devs[:1], []),
                     "4": plan_from_boundaries("bench", units, devs[1:], [q, 2 * q, 3 * q])}
            for p in plans.values():
                co.load(p, str(model_dir), threads=threads)
            co.sync_clocks()
            setups[n] = (cluster, co, plans)
        for rnd in range(args.rounds + 1):  # the first round warms up
            print(f"round {rnd}/{args.rounds}", file=sys.stderr, flush=True)
            for n in names:
                cluster, co, plans = setups[n]
                for key, plan in plans.items():
                    devs = list(plan.devices())
                    pids = [cluster.pid_of(d) for d in devs]
                    c0 = sum(rt.proc_cpu_s(p) for p in pids)
                    r = co.run(plan, request)
                    cpu = sum(rt.proc_cpu_s(p) for p in pids) - c0
                    if not rnd:
                        continue
                    f = fig[n]
                    f[f"tok_s_{key}"].append(decode_tokens_per_s(r.token_events))
                    f[f"cpu_{key}"].append(cpu / args.new_tokens)
                    f[f"over_{key}"].append(statistics.median(rt.step_overhead_s(r.events, r.token_events, devs)))
                    f[f"comp_{key}"].append(statistics.median(rt.step_compute_s(r.events, devs)))
        load.append(os.getloadavg()[0])
    med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in fig.items()}
    out: dict = {"bench": "omp_wait", "rounds": args.rounds, "new_tokens": args.new_tokens,
                 "load_avg_1min": [round(x, 2) for x in load], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for n, m in med.items():
        threads, env = VARIANTS[n]
        out[n] = {
            "threads": threads,
            "env": {k: v for k, v in env.items() if v is not None},
            "tok_s_1_stage": round(m["tok_s_1"], 2),
            "tok_s_4_stages": round(m["tok_s_4"], 2),
            "four_vs_one": round(m["tok_s_4"] / m["tok_s_1"], 3),
            "four_vs_one_per_round": [round(a / b, 3) for a, b in zip(fig[n]["tok_s_4"], fig[n]["tok_s_1"])],
            "cpu_ms_per_token_1_stage": round(m["cpu_1"] * 1e3, 2),
            "cpu_ms_per_token_4_stages": round(m["cpu_4"] * 1e3, 2),
            "four_vs_one_cpu": round(m["cpu_1"] / m["cpu_4"], 3),
            "step_compute_ms_1_stage": round(m["comp_1"] * 1e3, 2),
            "step_compute_ms_4_stages_sum": round(m["comp_4"] * 1e3, 2),
            "hop_us_from_steps": round((m["over_4"] - m["over_1"]) / 4 * 1e6, 1),
            "hop_us_from_steps_per_round": [round((a - b) / 4 * 1e6, 1)
                                            for a, b in zip(fig[n]["over_4"], fig[n]["over_1"])],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
