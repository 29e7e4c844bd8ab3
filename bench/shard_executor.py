"""What the stage executor itself costs, without any transport; prints one JSON line.

Model: the generated ≈170 M-parameter Llama of ``core.models.checkpoints.BENCHMARK_RECIPE``
(made once into ``--model`` if missing). Measured side by side in interleaved rounds:

- ``stage_vs_hf``: greedy decode tokens/s of one ``StageExecutor`` holding every unit over
  the HF model's own forward with a DynamicCache (what ``generate`` runs per token);
- ``four_stages_vs_one``: the same model as 4 executors chained in-process (the hops of a
  real run minus the network) over 1 executor;
- per-stage weight bytes of an even 4-stage split and the load time of each stage.

Ratios use medians of per-round rates and, because this machine is shared, also the 10th
percentile of per-token times (``*_quiet``: the speed when the process had the cores).

Usage: python bench/shard_executor.py [--model DIR] [--rounds 5] [--new-tokens 24] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch


def decode_times(step, first_token: torch.Tensor, new_tokens: int) -> list[float]:
    times, token = [], first_token
    for _ in range(new_tokens):
        started = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - started)
    return times


def hf_run(model, ids, mask, new_tokens):
    from transformers import DynamicCache

    from agents.step_inputs import cache_keyword

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        kw = {cache_keyword(type(model).forward): cache}
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **kw)
        state = {"mask": mask}

        def step(token):
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones((1, 1))], dim=1)
            logits = model(input_ids=token, attention_mask=state["mask"], use_cache=True, logits_to_keep=1, **kw).logits
            return logits[:, -1].argmax(-1, keepdim=True)

        return decode_times(step, out.logits[:, -1].argmax(-1, keepdim=True), new_tokens)


def chain_run(executors, ids, mask, new_tokens, idle_s: float = 0.0):
    """Decode through ``executors`` in turn; ``idle_s`` > 0: the thread sleeps that long before
    each stage's step (as a stage process waits while the others compute) and only the
    computations are timed — what idleness alone costs the next computation."""
    x = ids
    for ex in executors:
        x = ex.prefill(0, x, mask)

    def step(token):
        y = token
        for ex in executors:
            y = ex.decode(0, y)
        return y.argmax(-1, keepdim=True)

    def idle_step(token):  # → (next token, seconds computing)
        y, busy = token, 0.0
        for ex in executors:
            time.sleep(idle_s)
            started = time.perf_counter()
            y = ex.decode(0, y)
            busy += time.perf_counter() - started
        return y.argmax(-1, keepdim=True), busy

    if idle_s > 0:
        times = []
        token = x.argmax(-1, keepdim=True)
        for _ in range(new_tokens):
            token, busy = idle_step(token)
            times.append(busy)
    else:
        times = decode_times(step, x.argmax(-1, keepdim=True), new_tokens)
    for ex in executors:
        ex.drop(0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import transformers

    from agents.shard import StageExecutor
    from core.models.checkpoints import make_benchmark_model

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        make_benchmark_model(model_dir)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    units = hf.config.num_hidden_layers + 2
    bounds = [0] + [1 + round(k * hf.config.num_hidden_layers / 4) for k in range(1, 4)] + [units]
    placements = {"huge": True, "mapped": False}  # weights in huge pages (the default) / left memory-mapped
    whole, four, load_s = {}, {}, {}
    for place, huge in placements.items():
        whole[place] = StageExecutor(str(model_dir), 0, units, huge_pages=huge)
        four[place], load_s[place] = [], []
        for start, end in zip(bounds, bounds[1:]):
            started = time.perf_counter()
            four[place].append(StageExecutor(str(model_dir), start, end, huge_pages=huge))
            load_s[place].append(round(time.perf_counter() - started, 3))

    ids = torch.randint(3, 1000, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    rates: dict[str, list[float]] = {}

    def idle_s() -> float:  # the other three stages' share of a token, as in a real 4-stage run
        return 0.75 / statistics.median(rates["one"]) if rates.get("one") else 0.03

    runs = {"hf": (lambda: hf_run(hf, ids, mask, args.new_tokens))}
    for place in placements:
        suffix = "" if place == "huge" else "_mapped"
        runs[f"one{suffix}"] = functools.partial(chain_run, [whole[place]], ids, mask, args.new_tokens)
        runs[f"four{suffix}"] = functools.partial(chain_run, four[place], ids, mask, args.new_tokens)
        # each stage idle for the other three stages' time before its step
        runs[f"four_idle{suffix}"] = (lambda p=place: chain_run(four[p], ids, mask, args.new_tokens, idle_s=idle_s()))
    rates.update({k: [] for k in runs})
    for run in runs.values():  # warm up (page in the memory-mapped weights, allocator, kernels)
        run()
    gaps: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times = run()
            rates[name].append(len(times) / sum(times))
            gaps[name].extend(times)

    def median(name):
        return statistics.median(rates[name])

    def quiet(name):
        return 1.0 / sorted(gaps[name])[len(gaps[name]) // 10]

    print(json.dumps({
        "bench": "shard_executor",
        "model": f"llama {hf.config.num_hidden_layers} layers, hidden {hf.config.hidden_size}, "
                 f"{sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M params, fp32",
        "threads": args.threads,
        "hf_tokens_per_s": round(median("hf"), 2),
        "stage_tokens_per_s": round(median("one"), 2),
        "four_stages_tokens_per_s": round(median("four"), 2),
        "stage_vs_hf": round(median("one") / median("hf"), 3),
        "stage_vs_hf_quiet": round(quiet("one") / quiet("hf"), 3),
        "four_stages_vs_one": round(median("four") / median("one"), 3),
        "four_stages_vs_one_quiet": round(quiet("four") / quiet("one"), 3),
        "four_stages_idle_vs_one": round(median("four_idle") / median("one"), 3),
        "four_stages_idle_vs_one_quiet": round(quiet("four_idle") / quiet("one"), 3),
        "idle_between_stage_steps_ms": round(750 / statistics.median(rates["one"]), 1),
        # the same with the weights left memory-mapped (4 KiB page-cache pages), over the same one stage
        "mapped_stage_tokens_per_s": round(median("one_mapped"), 2),
        "mapped_four_stages_vs_one": round(median("four_mapped") / median("one"), 3),
        "mapped_four_stages_idle_vs_one": round(median("four_idle_mapped") / median("one"), 3),
        "mapped_four_stages_idle_vs_one_quiet": round(quiet("four_idle_mapped") / quiet("one"), 3),
        "huge_over_mapped_one_stage": round(median("one") / median("one_mapped"), 3),
        "huge_page_mb": round(whole["huge"].huge_page_bytes / 2**20, 1),
        "four_stage_units": [[a, b] for a, b in zip(bounds, bounds[1:])],
        "four_stage_weight_mb": [round(ex.memory_bytes() / 2**20, 1) for ex in four["huge"]],
        "four_stage_load_s": load_s,
        "whole_weight_mb": round(whole["huge"].memory_bytes() / 2**20, 1),
        "loadavg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    main()
