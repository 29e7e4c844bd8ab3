"""The profile's predicted decode step of a stage beside that stage's measured step; prints one JSON line.

Model: the demo's recipe (Llama, 6 layers, hidden 128, vocab 4096, as ``bench/serve.py`` makes it); the
stage: the middle one of its 3-stage split (units 3-5: three decoder blocks), ``agents.shard.StageExecutor``
on the checkpoint, in-process on one thread. For 1, 6 and 16 rows, each round:

- ``measured_us``: the stage's decode steps (prefill of ``--context`` tokens, then ``--steps`` decode
  steps; CPU time, ``time.thread_time``), the median step;
- ``predicted_us``: the profile of the same units (``agents.profiler.profile_units``: random weights
  from the config alone, so out of sample; warm, one thread, CPU time, at the steps' mean context):
  the units' decode times plus the stage's decode overhead, as the planner's cost model adds them;
- with ``--baseline TREE``: that checkout's ``agents/profiler.py`` profiles in the same rounds
  (``baseline_predicted_us``).

``ratio``: predicted over measured, medians over ``--rounds`` (1.0: the profile predicts the step).
The 1-minute load is reported before and after.
Usage: python bench/profile_vs_stage.py [--rounds 5] [--baseline OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

UNITS = (3, 4, 5)
"""The middle stage of the demo's 3-stage split: decoder blocks 2, 3 and 4."""
ROWS = (1, 6, 16)


def _profiler(tree: str | None):
    """This tree's ``agents.profiler``, or the checkout ``tree``'s with its own ``agents`` modules (swapped
    out of ``sys.modules`` while it imports, then back: the profiler calls the stage runtime it shipped with)."""
    if tree is None:
        from agents import profiler

        return profiler
    ours = {k: v for k, v in sys.modules.items() if k == "agents" or k.startswith("agents.")}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        module = importlib.import_module("agents.profiler")
        importlib.import_module("agents.shard")  # what it imports when it profiles, from its own tree
        importlib.import_module("agents.step_inputs")
        theirs = {k: v for k, v in sys.modules.items() if k == "agents" or k.startswith("agents.")}
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k == "agents" or k.startswith("agents.")]:
            del sys.modules[k]
        sys.modules.update(ours)
    return _Swapped(module, theirs)


class _Swapped:
    """A baseline tree's profiler whose ``profile_units`` runs with that tree's ``agents`` modules in
    ``sys.modules`` (its lazy imports find its own runtime), this tree's put back after."""

    def __init__(self, module, modules: dict) -> None:
        self.module, self.modules = module, modules

    def profile_units(self, *args, **kwargs):
        ours = {k: v for k, v in sys.modules.items() if k == "agents" or k.startswith("agents.")}
        sys.modules.update(self.modules)
        try:
            return self.module.profile_units(*args, **kwargs)
        finally:
            for k in self.modules:
                sys.modules.pop(k, None)
            sys.modules.update(ours)


def _measured_us(torch, stage, hidden: int, rows: int, context: int, steps: int) -> float:
    stage.prefill(0, torch.randn(rows, context, hidden), torch.ones(rows, context, dtype=torch.long))
    stage.decode(0, torch.randn(rows, 1, hidden))  # the first step learns the mask and checks the rotary table
    times = []
    for _ in range(steps):
        x = torch.randn(rows, 1, hidden)
        t0 = time.thread_time()
        stage.decode(0, x)
        times.append(time.thread_time() - t0)
    stage.drop(0)
    return statistics.median(times) * 1e6


def _predicted_us(profiler, config: dict, rows: int, context: int, repeats: int) -> float:
    from agents.protocol import ComputeOptions

    prof = profiler.profile_units(ComputeOptions(config=config, units=UNITS, batch_sizes=(rows,), prompt_tokens=context,
                                                 context_tokens=context, repeats=repeats, warmup=2, threads=1),
                                  cache_bytes=0, clock=time.thread_time)
    return (sum(u.decode_s[0] for u in prof.units) + prof.stage_decode_overhead_s) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20, help="the profile's timed repeats per unit")
    parser.add_argument("--baseline", help="a checkout whose agents/profiler.py to compare")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    import torch

    from agents.shard import StageExecutor
    from core.models.checkpoints import ModelRecipe, make_model

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="profile-vs-stage-"))
    model = make_model(ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7),
                       folder / "demo-like")
    config = json.loads((model / "config.json").read_text())
    stage = StageExecutor(str(model), UNITS[0], UNITS[-1] + 1)
    kinds = {"this": _profiler(None)}
    if args.baseline:
        kinds["baseline"] = _profiler(args.baseline)
    mean_context = args.context + 1 + args.steps // 2
    got: dict[str, dict[int, list[float]]] = {k: {r: [] for r in ROWS} for k in ("measured", *kinds)}
    with torch.inference_mode():
        for r in range(args.rounds):
            for rows in ROWS:
                got["measured"][rows].append(_measured_us(torch, stage, config["hidden_size"], rows, args.context,
                                                          args.steps))
                for kind in (list(kinds) if r % 2 == 0 else list(reversed(kinds))):
                    got[kind][rows].append(_predicted_us(kinds[kind], config, rows, mean_context, args.repeats))
    med = {k: {rows: statistics.median(v) for rows, v in by.items()} for k, by in got.items()}
    out = {"measured_us": {rows: round(med["measured"][rows], 1) for rows in ROWS},
           "predicted_us": {rows: round(med["this"][rows], 1) for rows in ROWS},
           "ratio": {rows: round(med["this"][rows] / med["measured"][rows], 3) for rows in ROWS}}
    if args.baseline:
        out["baseline_predicted_us"] = {rows: round(med["baseline"][rows], 1) for rows in ROWS}
        out["baseline_ratio"] = {rows: round(med["baseline"][rows] / med["measured"][rows], 3) for rows in ROWS}
    out["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
