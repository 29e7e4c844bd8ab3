"""MoE expert offloading (EdgeMoE, issue 16) benchmark: prints one JSON line.

A small Mixtral (4 blocks, 8 experts, top-2) trained briefly on the fortunes text (so its
router has learned something; cached under the user's cache dir) runs greedy decoding
(batch 1, on-device) on held-out prompts, with every expert read from the checkpoint on
storage throttled to ``BANDWIDTH`` bytes/s, at memory budgets of 25 %, 50 % and 75 % of the
model, side by side in one run:

- IO-FREE: the whole model resident (agents.shard; the speed limit; its memory is 100 %);
- IO-EXP: experts loaded on demand into a buffer filling the budget, LRU, no preload;
- EdgeMoE (this executor): same buffer, EdgeMoE's frequency+position eviction, predictive
  preload (2 per layer) from an activation profile built offline on other sample text;
- LRU+preload: the same preload with LRU eviction (eviction policy compared alone).

For each: tokens/s, buffer hit rate, predictor top-k recall, bytes read, and the peak
memory the stage held (resident weights + peak expert bytes, measured by the buffer) against
the budget. Tokens are checked equal to IO-FREE's (full precision).

Not measured (not built yet, keys null with a reason): IO-QEXP and STI (need quantised expert
files), perplexity of the bit-width-adapted model, average bits per expert weight.

Run: python bench/expert_offload.py   (EDGEMOE_BENCH_TOKENS, EDGEMOE_BENCH_BW to change)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from agents.expert_offload import ExpertOffloadExecutor  # noqa: E402
from agents.local_pipeline import generate_partitioned  # noqa: E402
from agents.sampling import SamplingParams  # noqa: E402
from agents.shard import StageExecutor  # noqa: E402
from core.models.checkpoints import ModelRecipe  # noqa: E402
from core.models.training import TrainingSettings, fortune_lines, train_model  # noqa: E402

RECIPE = ModelRecipe(family="mixtral", layers=4, hidden=128, heads=4, kv_heads=2, vocab=1024, experts=8, seed=3)
BANDWIDTH = float(os.environ.get("EDGEMOE_BENCH_BW", 100e6))
"""Bytes/s of the emulated storage (an SD card class)."""
TOKENS = int(os.environ.get("EDGEMOE_BENCH_TOKENS", 24))
BUDGETS = (0.25, 0.50, 0.75)


def trained_model() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgeshard" / "bench-mixtral-4x8"
    if not (cache / "config.json").is_file():
        shutil.rmtree(cache, ignore_errors=True)
        train_model(RECIPE, fortune_lines(), cache, settings=TrainingSettings(steps=400, max_seconds=180))
    return cache


def prompts(model_dir: Path, lines: list[str]):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok([line], return_tensors="pt") for line in lines]


def generate(executor, encoded) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_new_tokens=TOKENS, eos_token_ids=(), pad_token_id=0)
    tokens, started = [], time.perf_counter()
    for enc in encoded:
        out = generate_partitioned([executor], enc["input_ids"], enc["attention_mask"], params)
        tokens.append(out.tokens[0].tolist())
    return tokens, len(encoded) * TOKENS / (time.perf_counter() - started)


def build_profile(model_dir: Path, work: Path, sample) -> Path:
    """Learn layer-to-layer expert transitions offline on sample text; store them with the model."""
    from safetensors.torch import save_file

    executor = ExpertOffloadExecutor(str(model_dir), 0, RECIPE.layers + 2, slots=RECIPE.layers * RECIPE.experts,
                                     preload=0)
    generate(executor, sample)
    executor.close()
    out = work / "model"
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    save_file({"transitions": executor.predictor.transitions.contiguous()}, str(out / "expert-profile.safetensors"))
    return out


def run_offloaded(model_dir: Path, encoded, slots: int, policy: str, preload: int):
    executor = ExpertOffloadExecutor(str(model_dir), 0, RECIPE.layers + 2, slots=slots, policy=policy,
                                     preload=preload, bandwidth_bps=BANDWIDTH)
    tokens, tps = generate(executor, encoded)
    executor.close()
    s = executor.stats()
    peak = executor.resident_bytes() + s["peak_expert_bytes"]
    return tokens, {"tokens_per_s": round(tps, 2), "hit_rate": round(s["hit_rate"], 3),
                    "predictor_recall": None if s["predictor_recall"] is None else round(s["predictor_recall"], 3),
                    "preloads": s["preloads"], "preload_hits": s["preload_hits"], "bytes_read": s["bytes_read"],
                    "peak_memory_bytes": peak}


def main() -> None:
    import tempfile

    torch.set_num_threads(1)
    model_dir = trained_model()
    lines = fortune_lines()
    sample, held_out = lines[:24], lines[-6:]
    encoded_sample, encoded = prompts(model_dir, sample), prompts(model_dir, held_out)
    with tempfile.TemporaryDirectory() as tmp:
        profiled = build_profile(model_dir, Path(tmp), encoded_sample)
        whole = StageExecutor(str(profiled), 0, RECIPE.layers + 2)
        ref_tokens, free_tps = generate(whole, encoded)
        model_bytes = whole.memory_bytes()
        probe = ExpertOffloadExecutor(str(profiled), 0, RECIPE.layers + 2, slots=1)
        probe.close()
        resident, expert = probe.resident_bytes(), probe.expert_bytes()
        rows, exact = [], True
        for fraction in BUDGETS:
            budget = int(fraction * model_bytes)
            slots = max(1, (budget - resident) // expert)
            row = {"budget_fraction": fraction, "budget_bytes": budget, "slots": int(slots),
                   "io_free": {"tokens_per_s": round(free_tps, 2), "peak_memory_bytes": model_bytes,
                               "within_budget": model_bytes <= budget}}
            for name, policy, preload in (("io_exp", "lru", 0), ("edgemoe", "edgemoe", 2),
                                          ("lru_preload", "lru", 2)):
                tokens, figures = run_offloaded(profiled, encoded, int(slots), policy, preload)
                exact = exact and tokens == ref_tokens
                figures["within_budget"] = figures["peak_memory_bytes"] <= budget
                row[name] = figures
            row["io_qexp"] = row["sti"] = None
            row["edgemoe_beats_io_exp"] = row["edgemoe"]["tokens_per_s"] > row["io_exp"]["tokens_per_s"]
            rows.append(row)
    print(json.dumps({
        "bench": "expert_offload", "model": "mixtral 4 blocks x 8 experts top-2, hidden 128, trained 400 steps",
        "model_bytes": model_bytes, "resident_bytes": resident, "expert_bytes": expert,
        "storage_bandwidth_bps": BANDWIDTH, "prompts": len(held_out), "new_tokens_each": TOKENS, "batch": 1,
        "tokens_equal_io_free": exact, "budgets": rows,
        "io_qexp": None, "sti": None, "not_measured_reason": "quantised expert files not built yet",
        "perplexity": None, "avg_bits_per_expert_weight": None,
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }))


if __name__ == "__main__":
    main()
