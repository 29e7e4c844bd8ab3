"""Does the profiler time a block the way the runtime runs it? Prints one JSON line.

For a stage of ``--blocks`` decoder blocks of a generated Llama, alternating step by step
(so a shared machine's load drift hits all three alike):

- the runtime's decode step of that stage (``agents.shard.StageExecutor.decode``, what
  the agent's compute event measures);
- the profile's prediction with per-block step inputs: each block's timed call builds its
  own positions, causal mask and rotary embedding and crops the cache (the profiler
  before the fix) — blocks × that;
- the prediction as profiled now: blocks × the block forward alone (inputs built once,
  cache reset untimed) + the once-per-stage overhead (``StageExecutor.decode`` on a stage of
  the profiled block, less its block's call, as ``agents.profiler`` times it since stop 40).

Reports each prediction over the runtime (median of per-step ratios) and the per-block
and per-stage terms in ms.

Usage: nice -n -10 python bench/investigations/profiler_vs_runtime.py [--model DIR] [--blocks 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "fidelity-llama-8x768"))
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--context", type=int, default=16)
    args = ap.parse_args()

    import torch

    from agents.profiler import _hf_config, _UnitBench
    from agents.shard import StageExecutor
    from core.models.checkpoints import ModelRecipe, make_model

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        make_model(ModelRecipe(family="llama", layers=8, hidden=768, vocab=1024, seed=0), model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = _hf_config(raw)
    hidden = int(raw["hidden_size"])
    k = min(args.blocks, int(raw["num_hidden_layers"]))
    torch.set_num_threads(1)
    ctx = args.context

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    with torch.inference_mode():
        bench = _UnitBench(cfg, 1, torch.float32, 0)
        per_block = bench.decode_fn(1, ctx)
        # the stage overhead is a stage's own decode step read on a clock less its block's call
        overhead, less_block = bench.stage_decode_overhead_fn(1, ctx)
        # the earlier method: step inputs built inside each block's timed call, cache crop timed too
        cache = bench._context_cache(1, ctx)
        x = bench._hidden(1, 1)
        mask = torch.ones(1, ctx + 1, dtype=torch.long)

        def inline():
            bench._block(x, mask, cache)
            cache.crop(-1)

        ex = StageExecutor(str(model_dir), 1, 1 + k, threads=1)  # units 1..k: k blocks
        rows = []
        for i in range(args.steps + 10):
            if i % 8 == 0:  # keep the runtime's context near the profiled one
                ex.prefill(0, torch.randn(1, ctx, hidden), torch.ones(1, ctx, dtype=torch.long))
            rt = timed(lambda: ex.decode(0, torch.randn(1, 1, hidden)))
            old = sum(timed(inline) for _ in range(k))
            new = 0.0
            for _ in range(k):
                per_block.reset()
                new += timed(per_block.run)
            start = less_block()
            overhead.run()
            ovh = less_block() - start
            if i >= 10:  # warm-up
                rows.append((rt, old, new, ovh))

    def med(values, scale=1.0):
        return round(statistics.median(values) * scale, 4)

    print(json.dumps({
        "bench": "profiler_vs_runtime",
        "model": f"llama hidden {hidden}, fp32, {k}-block stage, context {ctx}",
        "machine_load": round(os.getloadavg()[0], 2),
        "steps": len(rows),
        "runtime_stage_decode_ms": med([r[0] for r in rows], 1e3),
        "per_block_inputs_block_ms": med([r[1] / k for r in rows], 1e3),
        "block_forward_ms": med([r[2] / k for r in rows], 1e3),
        "stage_overhead_ms": med([r[3] for r in rows], 1e3),
        "per_block_inputs_predicted_over_runtime": med([r[1] / r[0] for r in rows]),
        "profiled_now_predicted_over_runtime": med([(r[2] + r[3]) / r[0] for r in rows]),
    }))


if __name__ == "__main__":
    main()
