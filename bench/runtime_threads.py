"""Where a token's CPU time goes, per agent process and thread: 1 stage vs 4 stages.

Runs the benchmark Llama (``bench/runtime.py`` makes it) sequentially on a solo agent and
on a 4-stage plan, in interleaved rounds, and reads every agent thread's CPU time from the
scheduler (/proc/PID/task/TID/schedstat, ns) before and after each run. Threads are
grouped by role: ``worker`` (the stage loop: compute + framing), ``control`` (pings,
event flushes), ``zmq_io`` (libzmq's IO thread: CurveZMQ and the sockets), ``other`` (main thread, ZAP authenticator).
Prints one JSON line of milliseconds of CPU per generated token, and per role the time the
threads were runnable but waiting for a core (run-queue wait) and how often they were
scheduled in, per token.

Usage: python bench/runtime_threads.py [--model DIR] [--rounds 4] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from agents.protocol import SamplingSpec
from core.runs.coordinator import Coordinator, RunRequest
from core.devices.local_cluster import LocalCluster
from core.planning.plan import plan_from_boundaries


def thread_stats(pid: int) -> dict[str, tuple[float, float, int]]:
    """Per thread: (CPU s, s runnable but waiting for a core, times scheduled in) from
    /proc/PID/task/TID/schedstat (the scheduler's own accounting: on-CPU ns, run-queue ns, slices)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            cpu, wait, runs = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:3]
            out[f"{tid}:{name}"] = (int(cpu) / 1e9, int(wait) / 1e9, int(runs))
        except (OSError, ValueError):
            pass
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    return {k: v[0] for k, v in thread_stats(pid).items()}


def busiest_threads(pid: int) -> list[str]:
    """The agent's own Python threads (not libzmq's IO threads, not the main thread, which
    imported torch and then sleeps), busiest first: after a run the worker (stage loop), then
    the control thread."""
    ranked = sorted((v, k) for k, v in thread_cpu_s(pid).items()
                    if not k.split(":", 1)[1].startswith("ZMQbg") and k.split(":")[0] != str(pid))
    return [k.split(":")[0] for _, k in reversed(ranked)]


def role(name: str, worker_tid: str, control_tid: str) -> str:
    tid, comm = name.split(":", 1)
    if comm.startswith("ZMQbg/IO"):
        return "zmq_io"
    if tid == worker_tid:
        return "worker"
    if tid == control_tid:
        return "control"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        from core.models.checkpoints import make_benchmark_model

        make_benchmark_model(args.model)
    units = json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"] + 2
    q = units // 4
    plans = {
        "1_stage": plan_from_boundaries("bench", units, ["solo"], []),
        "4_stages": plan_from_boundaries("bench", units, ["s0", "s1", "s2", "s3"], [q, 2 * q, 3 * q]),
    }
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).tolist()
    req = RunRequest(input_ids=tuple(map(tuple, ids)), attention_mask=((1,) * 16,), max_new_tokens=args.new_tokens,
                     mode="sequential", eos_token_ids=(), sampling=SamplingSpec())
    totals: dict[str, dict[str, dict[str, float]]] = {k: {} for k in plans}
    waits: dict[str, dict[str, float]] = {k: {} for k in plans}  # role -> s waiting for a core
    runs: dict[str, dict[str, int]] = {k: {} for k in plans}  # role -> times scheduled in
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(tmp, ["solo", "s0", "s1", "s2", "s3"], threads_per_agent=1) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=60) as co:
        for plan in plans.values():
            co.load(plan, args.model, threads=1)
        # the worker is the thread with most CPU after a warm-up run, control the second
        tids = {}
        for key, plan in plans.items():
            co.run(plan, req)
            for d in plan.devices():
                busiest = busiest_threads(cluster.pid_of(d))
                tids[d] = (busiest[0], busiest[1])
        for _ in range(args.rounds):
            for key, plan in plans.items():
                before = {d: thread_stats(cluster.pid_of(d)) for d in plan.devices()}
                co.run(plan, req)
                for d in plan.devices():
                    for name, (cpu, wait, n) in thread_stats(cluster.pid_of(d)).items():
                        r = role(name, *tids[d])
                        b_cpu, b_wait, b_n = before[d].get(name, (0.0, 0.0, 0))
                        per = totals[key].setdefault(d, {})
                        per[r] = per.get(r, 0.0) + cpu - b_cpu
                        waits[key][r] = waits[key].get(r, 0.0) + wait - b_wait
                        runs[key][r] = runs[key].get(r, 0) + n - b_n
    tokens = args.rounds * args.new_tokens
    out: dict = {"bench": "runtime_threads", "unit": "ms CPU per generated token", "load_avg_1min": os.getloadavg()[0]}
    for key, per_dev in totals.items():
        out[key] = {d: {r: round(v / tokens * 1e3, 2) for r, v in sorted(roles.items())} for d, roles in per_dev.items()}
        out[f"{key}_total"] = round(sum(sum(r.values()) for r in per_dev.values()) / tokens * 1e3, 2)
    out["extra_ms_4_vs_1"] = round(out["4_stages_total"] - out["1_stage_total"], 2)
    # waiting for a core (runnable, not running) and wake-ups, per generated token, all agents' threads
    out["run_queue_wait_ms_per_token"] = {k: {r: round(v / tokens * 1e3, 2) for r, v in sorted(w.items())}
                                          for k, w in waits.items()}
    out["scheduled_in_per_token"] = {k: {r: round(v / tokens, 1) for r, v in sorted(n.items())} for k, n in runs.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
