"""A stage's decode step, in-process and on one thread, against the same blocks in transformers'
own forward; prints one JSON line.

Model: the demo's recipe, as ``bench/serve.py`` makes it (Llama, 6 layers, hidden 128, vocab 4096).
For 1, 6 and 16 rows (left-padded as the server's micro-batches are: row i has i % 3 pads) and the
2- and 3-stage splits ``bench/serve.py`` plans, each round prefills a 6-token prompt and runs
``--steps`` greedy decode steps through the chained ``StageExecutor``s, and through the HF model's
forward with a ``DynamicCache`` (what ``generate`` runs per token, ``logits_to_keep=1``):

- ``stage_us``: per stage, the median CPU time of its decode step (``time.thread_time``: on shared
  cores the wall clock counts other engineers' work), µs; steps run in inference mode, as a stage run's;
- ``outside_blocks_us``: per stage, the median of its step's CPU less its blocks' calls (``_run_layer``,
  timed around each): the stage's own work around the forward (checks, mask, positions, rotary, head);
- ``stages_us``: their sum, one micro-batch's step through the whole pipeline;
- ``hf_us``: the HF forward's step of the whole model for the same rows;
- with ``--baseline TREE``: that checkout's ``agents.shard`` runs the same steps in the same rounds
  (the order alternating): ``baseline_stages_us`` and ``vs_baseline`` (this tree's sum over the
  baseline's), and ``identical``: whether both trees' last-stage logits were bit-identical.

The 1-minute load is reported before and after: CPU times swing with it too (shared caches).
Usage: python bench/stage_step.py [--steps 32] [--rounds 5] [--baseline OTHER_CHECKOUT]
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

SPLITS = {2: [(0, 4), (4, 8)], 3: [(0, 3), (3, 6), (6, 8)]}
"""Units of the demo's 8 (embedding, 6 blocks, head) per stage, as ``bench/serve.py`` plans them."""


def shard_module_of(tree: Path):
    """``agents.shard`` of the checkout ``tree``, imported beside this tree's own (the ``agents``
    modules swapped out of ``sys.modules`` while it imports, then back)."""
    ours = {k: v for k, v in sys.modules.items() if k == "agents" or k.startswith("agents.")}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        return importlib.import_module("agents.shard")
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k == "agents" or k.startswith("agents.")]:
            del sys.modules[k]
        sys.modules.update(ours)


def prompt(torch, rows: int):
    ids = torch.randint(5, 4000, (rows, 6), generator=torch.Generator().manual_seed(rows))
    mask = torch.ones(rows, 6, dtype=torch.long)
    for i in range(rows):
        mask[i, : i % 3] = 0
    return ids, mask


def stage_steps(torch, stages, rows: int, steps: int) -> tuple[list[list[int]], list[list[int]], object]:
    """Per stage, the thread CPU ns of each decode step and of its blocks' calls (``_run_layer``, timed around
    each call); and the last logits. In inference mode, as a stage run's step calls ``decode``."""
    ids, mask = prompt(torch, rows)
    x = ids
    blocks = [0]

    def timed(run):
        def run_timed(*args):
            t = time.thread_time_ns()
            out = run(*args)
            blocks[0] += time.thread_time_ns() - t
            return out
        return run_timed

    for s in stages:
        s._run_layer = timed(type(s)._run_layer)
    with torch.inference_mode():
        for s in stages:
            x = s.prefill(0, x, mask)
        token = x.argmax(-1, keepdim=True)
        times: list[list[int]] = [[] for _ in stages]
        inside: list[list[int]] = [[] for _ in stages]
        for _ in range(steps):
            x = token
            for k, s in enumerate(stages):
                blocks[0] = 0
                t = time.thread_time_ns()
                x = s.decode(0, x)
                times[k].append(time.thread_time_ns() - t)
                inside[k].append(blocks[0])
            token = x.argmax(-1, keepdim=True)
    for s in stages:
        s.drop(0)
        del s._run_layer
    return times, inside, x


def hf_steps(torch, model, rows: int, steps: int) -> list[int]:
    from transformers import DynamicCache

    ids, mask = prompt(torch, rows)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 0),
                    cache=cache, use_cache=True, logits_to_keep=1)
        token, times = out.logits[:, -1].argmax(-1, keepdim=True), []
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            t = time.thread_time_ns()
            out = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        cache=cache, use_cache=True, logits_to_keep=1)
            times.append(time.thread_time_ns() - t)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: the demo's recipe, made in a temp dir)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,6,16")
    ap.add_argument("--baseline", type=Path, help="a checkout whose agents.shard runs the same steps")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from core.models.checkpoints import ModelRecipe, make_model

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    model = Path(args.model) if args.model else make_model(
        ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7),
        Path(tempfile.mkdtemp(prefix="bench-stage-step-")) / "demo")
    trees = {"this": importlib.import_module("agents.shard")}
    if args.baseline is not None:
        trees["baseline"] = shard_module_of(args.baseline.resolve())
    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    out: dict = {"bench": "stage_step", "steps": args.steps, "rounds": args.rounds, "load_1min_before": load_before}
    for n_stages, split in SPLITS.items():
        built = {name: [mod.StageExecutor(str(model), a, b) for a, b in split] for name, mod in trees.items()}
        for rows in (int(r) for r in args.rows.split(",")):
            per: dict[str, list[list[int]]] = {name: [[] for _ in split] for name in built}
            outside: dict[str, list[list[int]]] = {name: [[] for _ in split] for name in built}
            hf_times: list[int] = []
            identical = True
            for r in range(args.rounds):
                logits = {}
                for name in (list(built) if r % 2 == 0 else list(built)[::-1]):
                    times, inside, logits[name] = stage_steps(torch, built[name], rows, args.steps)
                    for k, (t, b) in enumerate(zip(times, inside)):
                        per[name][k] += t
                        outside[name][k] += [a - c for a, c in zip(t, b)]
                hf_times += hf_steps(torch, hf, rows, args.steps)
                if "baseline" in logits:
                    identical = identical and torch.equal(logits["this"], logits["baseline"])
            med = {name: [statistics.median(t) / 1e3 for t in per[name]] for name in built}
            out_med = {name: [round(statistics.median(t) / 1e3, 1) for t in outside[name]] for name in built}
            res = {"stage_us": [round(v, 1) for v in med["this"]], "stages_us": round(sum(med["this"]), 1),
                   "outside_blocks_us": out_med["this"], "hf_us": round(statistics.median(hf_times) / 1e3, 1)}
            if "baseline" in med:
                res.update(baseline_stage_us=[round(v, 1) for v in med["baseline"]],
                           baseline_outside_blocks_us=out_med["baseline"],
                           baseline_stages_us=round(sum(med["baseline"]), 1),
                           vs_baseline=round(sum(med["this"]) / sum(med["baseline"]), 3), identical=identical)
            out[f"stages_{n_stages}_rows_{rows}"] = res
    out["load_1min_after"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
