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
- per step of the ring (a micro-batch's compute start at the source to its next step's, every stage's
  part of that same step matched by micro-batch and step): medians of the ``cycle``, its forwards
  (``compute_us_p50``), the stages' own work around them (``on_stage_us_p50``: arrival to forward, and
  forward to the send call) and ``hops_us_p50``, the cycle less both (offset-free: from each send call's
  start to the next stage's arrival: the call itself, libzmq's IO threads, TCP, CurveZMQ and the wake-up).

``level_cycles``: the level's span in its own median ring cycles (``level_in_cycles``; 64 for 2 waves of 32
full steps) and ``level_steps``, the source's steps in it.

``--hot``: after each served side, the plan's stages in this process, one after the other, hot (``HotStages``:
16 rows prefilled with the bench's prompts, then ``--new-tokens`` greedy decode steps): each stage's median
16-row decode step (``hot_stage_us``) and the served one over it (``compute_over_hot``, per stage and for their
sum): what taking turns with the other stages' processes on one core costs a stage's forwards. ``--evict-mib N``
runs them a second time touching N MiB between stage steps (``evicted_stage_us``): a cache that the other
stages' processes have emptied, reproduced in one process.

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
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agents.arguments import int_in  # noqa: E402  (a bad number is one line and exit 2, before any work)
from bench import serve as served  # noqa: E402  (bench/serve.py: its Server, clients, CPU readings and checks)


def _med_us(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e6, 1) if xs else None


def step_path(workspace: Path, stages: int) -> dict:
    """Per stage, the medians of its decode steps' parts (µs), and per step of the ring its cycle and hops,
    from the stream's recorded events (each step's parts matched by micro-batch and step, so the hops are
    the cycle less that same step's parts, whatever its rows)."""
    db = sqlite3.connect(workspace)
    rows = db.execute("SELECT stage, kind, step, micro_batch, start_s, end_s, clock_uncertainty_s FROM stream_events "
                      "WHERE phase = 'decode' ORDER BY stage, start_s").fetchall()
    db.close()
    ev: dict[tuple[str, int, int, int], list[tuple[float, float]]] = defaultdict(list)  # (kind, stage, mb, step)
    for stage, kind, step, mb, start, end, _ in rows:  # a retired micro-batch's index starts again at step 0
        ev[(kind, stage, mb, step)].append((start, end))

    def near(key: tuple, t: float, before: bool) -> tuple[float, float] | None:
        """``key``'s event that ends last by ``t`` (``before``), else that starts first from ``t`` (within
        SLOP_S either way: the stages' events are mapped by offsets estimated apart)."""
        got = [e for e in ev.get(key, ()) if (e[1] <= t + SLOP_S if before else e[0] >= t - SLOP_S)]
        return (max(got, key=lambda e: e[1]) if before else min(got)) if got else None

    parts: dict[int, dict[str, list[float]]] = {s: defaultdict(list) for s in range(stages)}
    ring: dict[str, list[float]] = defaultdict(list)
    for (kind, s, mb, step), spans in ev.items():
        if kind != "compute":
            continue
        for start, end in spans:
            p = parts[s]
            p["compute"].append(end - start)
            # the message this compute answers: the upstream's hidden states of this step, or at the source
            # the last stage's tokens of the step before
            got = near(("recv_wait", s, mb, step - 1 if s == 0 else step), start, before=True)
            if got is not None:
                p["wait"].append(got[1] - got[0])
                p["recv_to_compute"].append(start - got[1])
                sent = near(("send", stages - 1 if s == 0 else s - 1, mb, step - 1 if s == 0 else step), got[1], True)
                if sent is not None:
                    p["hop_mapped"].append(got[1] - sent[1])
            sent = near(("send", s, mb, step), end, before=False)
            if sent is not None:
                p["compute_to_send"].append(sent[0] - end)
                p["send"].append(sent[1] - sent[0])
            if s == 0:
                _ring_step(ring, near, stages, mb, step, start)
    uncertainty = [r[6] for r in rows]
    return {**level_in_cycles([(start, end) for stage, kind, _, _, start, end, _ in rows
                               if stage == 0 and kind == "compute"]),
            "per_stage_us": {s: {k: _med_us(v) for k, v in sorted(p.items())} for s, p in parts.items()},
            "decode_steps": {s: len(p["compute"]) for s, p in parts.items()},
            "ring_steps": len(ring["cycle"]), "cycle_us_p50": _med_us(ring["cycle"]),
            "compute_us_p50": _med_us(ring["compute"]), "on_stage_us_p50": _med_us(ring["on_stage"]),
            "hops_us_p50": _med_us(ring["hops"]),
            "clock_uncertainty_us_max": round(max(uncertainty) * 1e6, 1) if uncertainty else None}


def level_in_cycles(source_computes: list[tuple[float, float]]) -> dict:
    """The served level (the last burst of the source's computes, after the warm-up) in its own steady cycles: its
    span over the median gap between the source's compute starts (one micro-batch: a ring step each). A level of
    ``--requests`` waves of ``--new-tokens`` full steps would span requests × new-tokens cycles; the rest is its
    waves (joins spread over steps, grown steps, partly filled ones). Dividing by the level's own cycle takes out
    the host's speed, which swings ±30 % within seconds here (docs/serving.md, *A second fresh host*)."""
    computes = sorted(source_computes)
    level: list[tuple[float, float]] = []
    for c in computes:
        if level and c[0] - level[-1][1] > LEVEL_GAP_S:
            level = []
        level.append(c)
    gaps = [b[0] - a[0] for a, b in zip(level, level[1:])]
    if not gaps:
        return {"level_steps": len(level), "level_cycles": None}
    return {"level_steps": len(level),
            "level_cycles": round((level[-1][1] - level[0][0]) / statistics.median(gaps), 1)}


LEVEL_GAP_S = 0.15
"""A pause in the source's computes this long ends a level (the warm-up's from the level's)."""


SLOP_S = 0.001
"""How far apart in time two stages' events of one step may read (their clock offsets' uncertainty)."""


def _ring_step(ring: dict, near, stages: int, mb: int, step: int, start: float) -> None:
    """One round of the ring: ``step``'s compute at the source (from ``start``) to the next step's there,
    every stage's part of that same step, and the hops as the cycle less them."""
    nxt = near(("compute", 0, mb, step + 1), start + SLOP_S, before=False)
    spans = [near(("compute", t, mb, step), start, before=False) for t in range(stages)]
    if nxt is None or None in spans:
        return
    sends = [near(("send", t, mb, step), spans[t][1], before=False) for t in range(stages)]
    # each stage's arrival of this step's input; at the source, of its tokens (before the next step)
    arrivals = [near(("recv_wait", t, mb, step), nxt[0] if t == 0 else spans[t][0], before=True) for t in range(stages)]
    if None in sends or None in arrivals:
        return
    # framing (a send call's own time overlaps the hop: the message may be on its way before it returns)
    on_stage = sum(sends[t][0] - spans[t][1] for t in range(stages))
    on_stage += sum(spans[t][0] - arrivals[t][1] for t in range(1, stages)) + nxt[0] - arrivals[0][1]
    compute = sum(e - b for b, e in spans)
    ring["cycle"].append(nxt[0] - start)
    ring["compute"].append(compute)
    ring["on_stage"].append(on_stage)
    ring["hops"].append(nxt[0] - start - compute - on_stage)


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


def stage_units(stages: int) -> list[tuple[int, int]]:
    """The bench plan's stages as unit ranges (embeddings, 6 blocks, head: 8 units)."""
    bounds = [0, *served.PLAN_BOUNDS[stages], 8]
    return list(zip(bounds, bounds[1:]))


class HotStages:
    """The stages ``units`` of ``model`` in this process (one torch thread), loaded once, and the bench's 16 prompts."""

    def __init__(self, model: Path, units: list[tuple[int, int]]) -> None:
        import torch

        from agents.shard import StageExecutor

        torch.set_num_threads(1)
        self.torch, self.enc = torch, served.encoded_prompts(model)
        self.stages = [StageExecutor(str(model), a, b, threads=1) for a, b in units]

    def steps(self, new_tokens: int, evict_mib: int = 0) -> dict:
        """The prompts prefilled afresh, then greedy decode steps one stage after the other: each stage's median
        decode step (s) and the tokens. With ``evict_mib``, that many MiB are touched before each stage's step (the
        caches emptied, as a stage finds them after the other stages' processes ran on its core)."""
        torch = self.torch
        junk = torch.zeros(evict_mib << 18) if evict_mib else None  # float32: 2**18 a MiB
        times: list[list[float]] = [[] for _ in self.stages]
        tokens = []
        with torch.inference_mode():
            x = self.enc["input_ids"]
            for stage in self.stages:  # a prefill starts the group's cache afresh
                x = stage.prefill(0, x, self.enc["attention_mask"])
            for step in range(new_tokens):
                nxt = (x if x.dim() == 2 else x[:, -1]).argmax(-1, keepdim=True)  # the head's logits: [B, V] or [B, T, V]
                tokens.append(nxt)
                if step == new_tokens - 1:
                    break
                x = nxt
                for stage, spent in zip(self.stages, times):
                    if junk is not None:
                        junk.add_(1)
                    t0 = time.perf_counter()
                    x = stage.decode(0, x)
                    spent.append(time.perf_counter() - t0)
        return {"stage_s": [statistics.median(t[min(4, len(t) - 1):]) for t in times],
                "tokens": torch.cat(tokens, dim=1)}


def hot_figures(served_stages: dict, hot: dict, evicted: dict | None) -> dict:
    """The served per-stage compute medians over the same stages' hot ones (and the evicted ones, when run)."""
    hot_us = [round(s * 1e6, 1) for s in hot["stage_s"]]
    compute = [served_stages.get(s, {}).get("compute") for s in range(len(hot_us))]
    out = {"hot_stage_us": hot_us}
    if None not in compute:
        out["compute_over_hot"] = [round(c / h, 2) for c, h in zip(compute, hot_us)] + [round(sum(compute) / sum(hot_us), 2)]
    if evicted is not None:
        out["evicted_stage_us"] = [round(s * 1e6, 1) for s in evicted["stage_s"]]
    return out


def _thread_counts(text: str) -> tuple[int, ...]:
    """``--threads``: one or more torch thread counts per agent, comma-separated (each a side)."""
    return tuple(int_in(1, 64)(part.strip()) for part in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=3, choices=(2, 3))
    ap.add_argument("--clients", type=int_in(1, 256), default=16)
    ap.add_argument("--requests", type=int_in(1, 100), default=2)
    ap.add_argument("--new-tokens", type=int_in(2, 256), default=32)
    ap.add_argument("--threads", type=_thread_counts, default=(1,),
                    help="torch threads per agent; a list (1,2): each a side of the rounds")
    ap.add_argument("--hf", action="store_true", help="transformers' batched generate of the same 16 prompts before "
                    "each round's sides (bench/serve.py's reference: the better of 1 and 2 threads): ratio per side")
    ap.add_argument("--hot", action="store_true", help="after each side, the plan's stages hot in this process: each "
                    "stage's 16-row decode step, and the served one over it")
    ap.add_argument("--evict-mib", type=int_in(1, 4096), default=None, help="with --hot: a second run touching this many "
                    "MiB between stage steps (the caches emptied)")
    ap.add_argument("--rounds", type=int_in(1, 1000), default=1, help="rounds over the trees, in rotating order")
    ap.add_argument("--tree", type=served.checkout_arg, action="append",
                    help="checkout(s) to serve from (default: this one)")
    args = ap.parse_args()
    if args.evict_mib is not None and not args.hot:
        ap.error("--evict-mib: measures the hot stages a second time; give it with --hot")
    from core import formats
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-step-path-"))
    model = make_model(ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7),
                       tmp / "demo")
    plan = tmp / "plan.json"
    formats.save(plan, plan_from_boundaries("demo", 8, [f"edge-{i}" for i in range(args.stages)],
                                            served.PLAN_BOUNDS[args.stages]))
    sides = [(t.resolve(), n) for t in args.tree or [ROOT] for n in args.threads]
    hf = served.HfBatched(model, args.new_tokens) if args.hf else None
    hot = HotStages(model, stage_units(args.stages)) if args.hot else None
    results = []
    try:
        _rounds(args, sides, hf, hot, tmp, model, plan, results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model and the servers' workspaces
    print(json.dumps({"bench": "serve_step_path", "stages": args.stages, "clients": args.clients,
                      "new_tokens": args.new_tokens, "load_1min_before": load_before,
                      "runs": results, "load_1min_after": os.getloadavg()[0]}))


def _rounds(args, sides, hf, hot, tmp: Path, model: Path, plan: Path, results: list) -> None:
    """Each round: ``generate``'s reference (``--hf``), then every side once, the order rotating."""
    for k in range(args.rounds):
        limit = max(got[0] for got in hf.best().values()) if hf is not None else None
        for tree, threads in sides[k % len(sides):] + sides[:k % len(sides)]:
            got = one_tree(tree, threads, tmp, model, plan, args, k)
            if limit is not None:
                got |= {"hf_tokens_per_s": round(limit, 1), "vs_hf_batched": round(got["tokens_per_s"] / limit, 3)}
            if hot is not None:  # right after the side: the same minutes of the host's speed
                evicted = hot.steps(args.new_tokens, args.evict_mib) if args.evict_mib else None
                got |= hot_figures(got["per_stage_us"], hot.steps(args.new_tokens), evicted)
            results.append(got)


if __name__ == "__main__":
    main()
