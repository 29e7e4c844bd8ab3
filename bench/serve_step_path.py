"""Where a served decode step's time goes, per stage, from the agents' own recorded events; one JSON line.

A real ``edgeshard serve --local`` (``bench/serve.py``'s ``Server``, demo recipe, no-bubbles,
micro-batches = stages) serves ``--clients`` concurrent streaming clients (``--requests`` each of
``--new-tokens`` greedy tokens); then the served stream's timeline events (``stream_events``: what
each agent recorded, on the stream's clock) are read back from the workspace. Per stage, over its
decode steps (each micro-batch's ``recv_wait`` → ``compute`` → ``send`` on that stage), medians in µs:

- ``wait``: blocked on the data socket (idle: the upstream stage or the hop is late);
- ``recv_to_compute``: the message's arrival to its forward's start (frame checks, tensor views, the
  open run's bookkeeping; at the source: the tokens' handling and the next step's input);
- ``compute``: the forward (and sampling at the last stage);
- ``compute_to_send`` / ``send``: framing the output, then handing it to libzmq;
- ``hop_mapped``: the upstream stage's send end to this stage's arrival, across the agents' clock
  offsets as the server estimated them (each event carries its uncertainty, up to
  ``clock_uncertainty_us_max``: hundreds of µs here, so a median hop of ~150 µs can read negative);
- ``cycle_us_p50``: one micro-batch's start of compute to its next step's start at the source (a whole
  round of the ring: every stage's step of it plus its hops), and ``hops_us_est``: that cycle less the
  stages' medians above (offset-free: what the zmq IO threads, TCP, CurveZMQ and the wake-ups of three
  hops took), beside ``compute_us`` and ``on_stage_us`` (the rest each stage's worker spent per step).

Beside them: tokens/s, the CPU per completion token of the server and each agent (``/proc``), and
the 1-minute load. ``--threads`` is the agents' torch threads; ``--tree`` another checkout's server
(before/after: run the script once per tree in the same minutes, or alternate ``--rounds``).
Usage: python bench/serve_step_path.py [--stages 3] [--clients 16] [--threads 1,2] [--hf] [--rounds 2]
       [--tree DIR]...
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serve as served  # noqa: E402  (bench/serve.py: its Server, clients and CPU readings)


def _med_us(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e6, 1) if xs else None


def step_path(workspace: Path, stages: int) -> dict:
    """Per stage, the medians of its decode steps' parts (µs), from the stream's recorded events."""
    db = sqlite3.connect(workspace)
    rows = db.execute("SELECT stage, kind, step, micro_batch, start_s, end_s, clock_uncertainty_s FROM stream_events "
                      "WHERE phase = 'decode' ORDER BY stage, start_s").fetchall()
    db.close()
    by_stage: dict[int, list[tuple]] = defaultdict(list)
    for r in rows:
        by_stage[r[0]].append(r)
    parts: dict[int, dict[str, list[float]]] = {s: defaultdict(list) for s in range(stages)}
    sends: dict[tuple[int, int, int], float] = {}  # (stage, mb, step) -> send end
    arrivals: dict[tuple[int, int, int], float] = {}  # (stage, mb, step) -> recv_wait end
    computes: dict[tuple[int, int], list[float]] = defaultdict(list)  # source: (mb) -> compute starts
    for s, evs in by_stage.items():
        p = parts[s]
        last: dict[str, tuple] = {}
        for _, kind, step, mb, start, end, _u in evs:
            if kind == "recv_wait":
                p["wait"].append(end - start)
                arrivals[(s, mb, step)] = end
            elif kind == "compute":
                p["compute"].append(end - start)
                got = last.get("recv_wait")
                if got is not None:
                    p["recv_to_compute"].append(start - got[5])
                if s == 0:
                    computes[mb].append(start)
            elif kind == "send":
                p["send"].append(end - start)
                c = last.get("compute")
                if c is not None and c[3] == mb:
                    p["compute_to_send"].append(start - c[5])
                sends[(s, mb, step)] = end
            last[kind] = (s, kind, step, mb, start, end)
    for (s, mb, step), got in arrivals.items():
        if s == 0:  # the source receives the tokens of the step it started, from the last stage
            sent = sends.get((stages - 1, mb, step))
        else:
            sent = sends.get((s - 1, mb, step))
        if sent is not None:
            parts[s]["hop_mapped"].append(got - sent)
    cycles = [b - a for starts in computes.values() for a, b in zip(starts, starts[1:])]
    uncertainty = [r[6] for r in rows]
    per_stage = {s: {k: _med_us(v) for k, v in sorted(p.items())} for s, p in parts.items()}
    compute = sum(p["compute"] or 0 for p in per_stage.values())
    on_stage = sum((p.get(k) or 0) for p in per_stage.values() for k in ("recv_to_compute", "compute_to_send", "send"))
    cycle = _med_us(cycles)
    return {"per_stage_us": per_stage, "decode_steps": {s: len(p["compute"]) for s, p in parts.items()},
            "cycle_us_p50": cycle, "compute_us": round(compute, 1), "on_stage_us": round(on_stage, 1),
            "hops_us_est": None if cycle is None else round(cycle - compute - on_stage, 1),
            "clock_uncertainty_us_max": round(max(uncertainty) * 1e6, 1) if uncertainty else None}


def one_tree(tree: Path, threads: int, tmp: Path, model: Path, plan: Path, args, k: int) -> dict:
    folder = tmp / f"r{k}-{tree.name}-t{threads}"
    srv = served.Server(folder, model, plan, args.stages, threads, tree=tree)
    try:
        served.stream_once(srv, "warm up", 4)
        got = served.served_cpu(srv, args.clients, args.requests, args.new_tokens)
    finally:
        status = srv.stop()
    path = step_path(srv.workspace, args.stages)
    cpu = got["cpu_ms_per_token"]
    return {"tree": str(tree), "threads": threads, "tokens_per_s": round(got["tokens_per_s"], 1), "all_done": got["all_done"],
            "tpot_ms_p50": got["tpot_ms_p50"], "exit_status": status, "load_1min": os.getloadavg()[0],
            "cpu_ms_per_token": {"server": round(cpu["server"], 3), "agents": [round(a, 3) for a in cpu["agents"]],
                                 "agents_total": round(sum(cpu["agents"]), 3), "clients": round(cpu["clients"], 3)},
            **path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=3, choices=(2, 3))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", default="1", help="torch threads per agent; a list (1,2): each a side of the rounds")
    ap.add_argument("--hf", action="store_true", help="transformers' batched generate of the same 16 prompts before "
                    "each round's sides (bench/serve.py's reference: the better of 1 and 2 threads): ratio per side")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the trees, in rotating order")
    ap.add_argument("--tree", type=Path, action="append", help="checkout(s) to serve from (default: this one)")
    args = ap.parse_args()
    from core import formats
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-step-path-"))
    model = make_model(ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7),
                       tmp / "demo")
    plan = tmp / "plan.json"
    formats.save(plan, plan_from_boundaries("demo", 8, [f"edge-{i}" for i in range(args.stages)],
                                            {2: [4], 3: [3, 6]}[args.stages]))
    sides = [(t.resolve(), int(n)) for t in args.tree or [ROOT] for n in args.threads.split(",")]
    hf = served.HfBatched(model, args.new_tokens) if args.hf else None
    results = []
    for k in range(args.rounds):
        limit = max(got[0] for got in hf.best().values()) if hf is not None else None
        for tree, threads in sides[k % len(sides):] + sides[:k % len(sides)]:
            got = one_tree(tree, threads, tmp, model, plan, args, k)
            if limit is not None:
                got |= {"hf_tokens_per_s": round(limit, 1), "vs_hf_batched": round(got["tokens_per_s"] / limit, 3)}
            results.append(got)
    print(json.dumps({"bench": "serve_step_path", "stages": args.stages, "clients": args.clients,
                      "new_tokens": args.new_tokens, "load_1min_before": load_before,
                      "runs": results, "load_1min_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
