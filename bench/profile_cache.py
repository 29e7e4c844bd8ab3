"""Profiled vs run decode time of a whole model on one CPU thread, the profiler's units timed
warm (one copy: how units were timed before 2026-11-26, less the device context that then added
per-op dispatch) and cold (copies in turn, ``agents.cold_profiling.cold_copies``); prints one JSON line.

Why: the miniature's edge-only predictions were 2.5x too fast (docs/experiments.md). One
decoder block of its model (hidden 512: 12.25 MiB) timed over and over stays in a 32 MiB L3,
while a decode step streams all 8 blocks through it. This measures that in one process, no
agents, no network: per round, the profile's decode time per token (every unit at batch 1
plus the stage overhead) timed warm, the same timed cold, and the median decode step of
``agents.shard.StageExecutor`` running the whole model. CPU time of the calling thread
(``time.thread_time``): on a shared machine, wall time mostly measures the neighbours.
A model whose blocks do not stay cached (``--hidden 768``: 28 MiB blocks) times the same both ways.

Usage: nice -n -10 python bench/profile_cache.py [--hidden 512] [--layers 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()

    import torch

    from agents.cold_profiling import last_level_cache_bytes
    from agents.profiler import profile_units
    from agents.protocol import ComputeOptions
    from agents.shard import StageExecutor
    from core.models.checkpoints import ModelRecipe, make_model

    torch.set_num_threads(1)
    prompt = 16
    with tempfile.TemporaryDirectory(prefix="edgeshard-profile-cache-") as tmp:
        model_dir = make_model(ModelRecipe(family="llama", layers=args.layers, hidden=args.hidden, vocab=1024, seed=0),
                               Path(tmp) / "model")
        config = json.loads((model_dir / "config.json").read_text())
        ex = StageExecutor(str(model_dir), 0, args.layers + 2, threads=1)
        llc = last_level_cache_bytes()

        def profiled_ms(cache_bytes: int) -> tuple[float, float]:
            """(per token, median decoder block) of the profile, ms."""
            p = profile_units(ComputeOptions(config=config, prompt_tokens=prompt, batch_sizes=(1,), repeats=5,
                                             threads=1), cache_bytes=cache_bytes, clock=time.thread_time)
            per_token = sum(u.decode_s[0] for u in p.units) + p.stage_decode_overhead_s
            return per_token * 1e3, statistics.median(u.decode_s[0] for u in p.units[1:-1]) * 1e3

        def run_ms() -> float:
            steps = []
            gen = torch.Generator().manual_seed(0)
            with torch.inference_mode():
                for _ in range(2):
                    logits = ex.prefill(0, torch.randint(3, 1024, (1, prompt), generator=gen),
                                        torch.ones(1, prompt, dtype=torch.long))
                    for _ in range(args.new_tokens):
                        t0 = time.thread_time()
                        logits = ex.decode(0, logits.argmax(-1, keepdim=True))
                        steps.append(time.thread_time() - t0)
                    ex.drop(0)
            return statistics.median(steps) * 1e3

        rounds = []
        started = time.perf_counter()
        for _ in range(args.rounds):
            load = os.getloadavg()[0]
            warm, warm_block = profiled_ms(0)
            cold, cold_block = profiled_ms(llc)
            run = run_ms()
            rounds.append({"load": round(load, 2), "warm_profile_ms": round(warm, 2), "cold_profile_ms": round(cold, 2),
                           "run_ms": round(run, 2), "warm_error": round(warm / run - 1, 3),
                           "cold_error": round(cold / run - 1, 3), "warm_block_ms": round(warm_block, 3),
                           "cold_block_ms": round(cold_block, 3)})
    print(json.dumps({
        "bench": "profile_cache",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, last-level cache {llc >> 20} MiB",
        "model": f"llama {args.layers} layers, hidden {args.hidden}, fp32, 1 thread, CPU time",
        "rounds": rounds,
        "median_warm_error": statistics.median(r["warm_error"] for r in rounds),
        "median_cold_error": statistics.median(r["cold_error"] for r in rounds),
        "wall_s": round(time.perf_counter() - started, 1),
    }))


if __name__ == "__main__":
    main()
