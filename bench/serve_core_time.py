"""What each core runs while `edgeshard serve --local` serves 16 streaming clients; prints one JSON line.

Why: with the agents placed (``core.devices.cpu_placement``) one core runs every stage in turn and is the
bottleneck, so whatever else runs there costs tokens one for one. This bench names it. A server of
``--tree`` (the demo recipe, ``--stages`` stages, 1 torch thread a stage) serves ``--levels`` levels of
``--clients`` streaming clients × ``--requests`` × ``--new-tokens`` (``bench/serve.py``'s clients and
model), each level recorded with ``perf sched record`` (the kernel's context switches; root): every
thread's run time on every core between the level's first request and its last token, by kind:

- ``agents_worker_and_rest``: the agents' threads but those below (the stages' workers: nearly all of it);
- ``agents_zmq_io``: libzmq's IO threads of the agents (``ZMQbg/IO/*``: every hop's send and receive);
- ``agents_control``: their control threads (named ``agent-control`` by the agents);
- ``server``: every thread of the server process; ``bench_clients``: this process's client threads;
  ``bench_rest``: its other threads; ``other``: every other process's (other users', the kernel's);
- ``idle``: the level's time left on that core.

``other_ms_by_name``: the most of ``other`` by process name (``perf`` itself among them: its recording costs).

Per level and core: ms and ms per completion token; ``busy`` is the core's share of the level not idle.
Usage: python bench/serve_core_time.py [--stages 3] [--levels 3] [--clients 16] [--requests 4] [--tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serve as served  # noqa: E402  (bench/serve.py: its server, clients and model)

LINE = re.compile(r"\s*([\d.]+)\s+\[(\d+)\]\s+(.*?)\[(\d+)(?:/\d+)?\]\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s*$")
"""A ``perf sched timehist`` row: switch-out time, core, task[tid/pid], wait, delay, run time (ms)."""


class ClientThreads:
    """The kernel ids of the threads ``bench/serve.py``'s ``stream_once`` runs on (the level's clients)."""

    def __init__(self) -> None:
        self.tids: set[int] = set()
        self._stream_once = served.stream_once
        served.stream_once = self._stream

    def _stream(self, *args, **kwargs):
        self.tids.add(threading.get_native_id())
        return self._stream_once(*args, **kwargs)


def _thread_names(pid: int) -> dict[int, str]:
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            names[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            pass
    return names


def _kind_of(tid: int, server: set[int], agents: dict[int, str], clients: set[int], bench: set[int]) -> str:
    if tid in agents:
        return "agents_" + served._thread_kind(agents[tid])
    return ("server" if tid in server else "bench_clients" if tid in clients else "bench_rest" if tid in bench
            else "other")


def level(srv, clients: ClientThreads, width: int, requests: int, new_tokens: int, folder: Path) -> dict:
    """One level under ``perf sched record``: each kind's run time per core over the level's span."""
    data = folder / "perf.data"
    perf = subprocess.Popen(["perf", "sched", "record", "-k", "CLOCK_MONOTONIC", "-o", str(data), "--", "sleep",
                             "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf is recording before the level starts (it prints nothing to wait on)
    ended = []
    completion_tokens = served._completion_tokens
    served._completion_tokens = lambda *a: ended.append(time.monotonic()) or completion_tokens(*a)
    t0 = time.monotonic()
    try:
        got = served.load_level(srv, width, requests, new_tokens)
    finally:
        served._completion_tokens = completion_tokens
        perf.send_signal(signal.SIGINT)
        perf.wait(60)
    t1 = ended[0]
    agent_pids = served._descendants(srv.proc.pid)
    agents = {tid: name for pid in agent_pids for tid, name in _thread_names(pid).items()}
    server, bench = set(_thread_names(srv.proc.pid)), set(_thread_names(os.getpid()))
    table = subprocess.run(["perf", "sched", "timehist", "-i", str(data)], capture_output=True, text=True).stdout
    data.unlink()
    run_ms: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    others: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # by process name
    for row in table.splitlines():
        m = LINE.match(row)
        if m is None or not t0 <= float(m.group(1)) <= t1:
            continue
        tid, core, ms = int(m.group(4)), int(m.group(2)), float(m.group(5))
        if tid == 0:
            continue
        kind = _kind_of(tid, server, agents, clients.tids, bench)
        run_ms[core][kind] += ms
        if kind == "other":
            others[core][m.group(3).strip()] += ms
    span_ms = (t1 - t0) * 1e3
    tokens = got["tokens_per_s"] * got["wall_s"]
    cores = {}
    for core in sorted(run_ms):
        kinds = dict(sorted(run_ms[core].items(), key=lambda kv: -kv[1]))
        kinds["idle"] = max(0.0, span_ms - sum(kinds.values()))
        cores[str(core)] = {"busy": 1 - kinds["idle"] / span_ms,
                            "ms": {k: round(v, 1) for k, v in kinds.items()},
                            "ms_per_token": {k: round(v / tokens, 4) for k, v in kinds.items() if k != "idle"},
                            "other_ms_by_name": {k: round(v, 1) for k, v in sorted(others[core].items(),
                                                                                   key=lambda kv: -kv[1])[:6]}}
    return {"tokens_per_s": got["tokens_per_s"], "tokens": tokens, "span_ms": span_ms, "all_done": got["all_done"],
            "load_1min": os.getloadavg()[0], "cores": cores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=3, choices=(2, 3))
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client per level")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose server runs (its code, its agents')")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("serve_core_time: needs perf (linux-perf) and the right to record the scheduler (root)")
    from core import formats
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-core-time-"))
    try:
        model = make_model(ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7),
                           tmp / "demo")
        plan = tmp / "plan.json"
        formats.save(plan, plan_from_boundaries("demo", 8, [f"edge-{i}" for i in range(args.stages)],
                                                served.PLAN_BOUNDS[args.stages]))
        clients = ClientThreads()
        srv = served.Server(tmp / "srv", model, plan, args.stages, 1, tree=args.tree)
        try:
            served.stream_once(srv, "warm up", 4)
            served.load_level(srv, args.clients, 1, args.new_tokens)  # warm: every row's path taken once
            levels = [level(srv, clients, args.clients, args.requests, args.new_tokens, tmp)
                      for _ in range(args.levels)]
        finally:
            exit_status = srv.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"bench": "serve_core_time", "stages": args.stages, "clients": args.clients,
                      "tree": str(args.tree), "load_1min_before": load_before, "levels": levels,
                      "exit_status": exit_status, "load_1min_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
