"""MoE expert offloading (EdgeMoE, issue 16) benchmark: prints one JSON line.

A small Mixtral (4 blocks, 8 experts, top-2) trained briefly (600 steps, 1 thread, at most
20 min) on the training split of the fortunes text (so its router has learned something;
cached under the user's cache dir) runs greedy decoding (batch 1, on-device) on 6 held-out
prompts, with every expert read from the checkpoint on storage
throttled to ``BANDWIDTH`` bytes/s, at memory budgets of 25 %, 50 % and 75 % of the model,
side by side in one run (best of 2 runs each):

- IO-FREE: the whole model resident (agents.shard; the speed limit; its memory is 100 %);
- IO-EXP: experts loaded on demand into a buffer filling the budget, LRU, no preload;
- IO-QEXP: the same with every expert uniform INT4 (so 8x the experts fit);
- STI-like: the next layer's every expert streamed in while the current one computes, LRU;
- EdgeMoE (this executor): EdgeMoE's frequency+position eviction, predictive preload (2 per
  layer) from an activation profile built offline on other sample text; at full precision
  and with the adapted per-expert bit widths;
- LRU+preload: the same preload with LRU eviction (eviction policy compared alone).

For each: tokens/s, buffer hit rate, predictor top-k recall, bytes read, and the peak
memory the stage held (resident weights + peak expert bytes, measured by the buffer) against
the budget. Full-precision tokens are checked equal to IO-FREE's.

Accuracy: the model is trained on the training split of the fortunes
(core.models.training.held_out_split: every 10th quotation held out, none shared); perplexity
(teacher-forced) on 20 held-out fortunes at fp32, uniform INT8/INT4/INT2 and EdgeMoE's
adaptation (``edgeshard moe adapt-bits``'s code: global lower/upper widths from the uniform
losses, importance = loss with one expert alone at the lower width, the least important K at
the lower width and the rest at the upper one, K raised while within a 5 % perplexity bound).
The activation profile is learnt on 48 training fortunes, its recall measured on 24 held-out
ones (out of sample) and on the 48 it was learnt on (in sample), side by side; the generation prompts
are 6 other held-out fortunes.

Prediction (issue 26, ``prediction_scores``; alone: ``--prediction-only``, a minute): the demo's
shipped MoE on demo agents (edge-a and edge-b with the demo's emulated budget and slowdown), profiled
the way the studio's *Profile agents* does (compute at batches 1/2/4, storage cold and page-cached);
EdgeMoE's plan run on the agents (greedy, no EOS) and predicted by the technique's simulator with
the run's batch. Per lane, predicted ÷ measured: storage = the summed expert reads (demand + preload),
compute = the device lane's busy time (the agent's step boxes, demand reads inside). The
configuration the model was developed on (edge-a, half the experts, 1 prompt) is in sample; the
others (another budget, 3 prompts, the slowed edge-b, other prompts) out of sample. Beside each, the
old model's ratios in the same run (cold bandwidth, no fixed cost per read, one sequence).

Run: python bench/expert_offload.py [--prediction-only]   (EDGEMOE_BENCH_TOKENS, EDGEMOE_BENCH_BW, EDGEMOE_BENCH_PPL_TEXTS,
EDGEMOE_BENCH_TRAIN_STEPS, EDGEMOE_BENCH_TRAIN_THREADS to change)
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

from agents.techniques.expert_offload.offload import ExpertOffloadExecutor, write_quantized_experts  # noqa: E402
from agents.local_pipeline import generate_partitioned  # noqa: E402
from agents.sampling import SamplingParams  # noqa: E402
from agents.shard import StageExecutor  # noqa: E402
from core.models.checkpoints import ModelRecipe  # noqa: E402
from core.models.training import TrainingSettings, fortune_lines, held_out_split, train_model  # noqa: E402
from core.techniques.expert_offload.profiling import activation_profile, bit_options, profile_recall  # noqa: E402

RECIPE = ModelRecipe(family="mixtral", layers=4, hidden=128, heads=4, kv_heads=2, vocab=1024, experts=8, seed=3)
BANDWIDTH = float(os.environ.get("EDGEMOE_BENCH_BW", 100e6))
"""Bytes/s of the emulated storage (an SD card class)."""
TOKENS = int(os.environ.get("EDGEMOE_BENCH_TOKENS", 24))
BUDGETS = (0.25, 0.50, 0.75)
TRAIN_STEPS = int(os.environ.get("EDGEMOE_BENCH_TRAIN_STEPS", 600))
TRAIN_THREADS = int(os.environ.get("EDGEMOE_BENCH_TRAIN_THREADS", 1))
PPL_TEXTS = int(os.environ.get("EDGEMOE_BENCH_PPL_TEXTS", 20))
ACCURACY_BOUND = 0.05
"""Perplexity may rise at most 5 % over fp32 (EdgeMoE's example bound)."""


def trained_model() -> Path:
    """The bench's model, trained on the training split of the text only (cached)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgeshard" / "bench-mixtral-4x8-split"
    if not (cache / "config.json").is_file():
        shutil.rmtree(cache, ignore_errors=True)
        train, _ = held_out_split(fortune_lines())
        train_model(RECIPE, train, cache, settings=TrainingSettings(steps=TRAIN_STEPS, max_seconds=1200,
                                                                   threads=TRAIN_THREADS))
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


def build_profile(model_dir: Path, work: Path, calibration, held_out) -> tuple[Path, dict]:
    """A copy of the model with its offline activation profile (``edgeshard moe profile-activations``:
    transitions learned on calibration text of the training split, top-k recall on held-out text)."""
    out = work / "model"
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    return out, activation_profile(out, calibration, held_out)


def run_offloaded(model_dir: Path, encoded, slots: int, policy: str, preload: int, whole_layers: bool = False):
    executor = ExpertOffloadExecutor(str(model_dir), 0, RECIPE.layers + 2, slots=slots, policy=policy,
                                     preload=preload, bandwidth_bps=BANDWIDTH, whole_layers=whole_layers)
    tokens, tps = generate(executor, encoded)
    executor.close()
    s = executor.stats()
    peak = executor.resident_bytes() + s["peak_expert_bytes"]
    return tokens, {"tokens_per_s": round(tps, 2), "hit_rate": round(s["hit_rate"], 3),
                    "predictor_recall": None if s["predictor_recall"] is None else round(s["predictor_recall"], 3),
                    "preloads": s["preloads"], "preload_hits": s["preload_hits"], "bytes_read": s["bytes_read"],
                    "peak_memory_bytes": peak}


def variant(base: Path, name: str, bits_of: dict | None) -> Path:
    """A copy of the model directory with these experts quantised (None: full precision)."""
    out = base.parent / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    if bits_of:
        write_quantized_experts(str(out), bits_of)
    return out


def adaptation(profiled: Path, texts) -> tuple[Path, dict]:
    """A copy of the model adapted by ``edgeshard moe adapt-bits`` on held-out ``texts`` (EdgeMoE's search:
    uniform INT8/INT4/INT2 for the global widths, importance at the lower one, K raised within the bound)."""
    out = variant(profiled, "adapted", None)
    return out, bit_options(out, texts, ACCURACY_BOUND)


def log(text: str) -> None:
    """Progress on stderr (stdout is the one JSON line)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def best_of(runs: int, fn):
    """Best tokens/s of ``runs`` tries (a loaded machine only slows a run down)."""
    results = [fn() for _ in range(runs)]
    return max(results, key=lambda r: r[1]["tokens_per_s"])


PREDICTION_PROMPTS = ("The river and its banks", "A wise man once said", "hello there my friend",
                      "Never trust a computer", "The early bird")
PREDICTION_CONFIGS = (  # (name, device, share of the experts held, prompts)
    ("edge-a half 1 prompt", "edge-a", 0.5, PREDICTION_PROMPTS[:1]),
    ("edge-a half 3 prompts", "edge-a", 0.5, PREDICTION_PROMPTS[1:4]),
    ("edge-a quarter 3 prompts", "edge-a", 0.25, PREDICTION_PROMPTS[2:5]),
    ("edge-b half 2 prompts", "edge-b", 0.5, PREDICTION_PROMPTS[3:5]),
)
IN_SAMPLE = ("edge-a half 1 prompt",)


class _Events:
    def __init__(self):
        self.events, self.tokens = [], []

    def on_event(self, event):
        self.events.append(event)

    def on_tokens(self, tokens):
        self.tokens.append(tokens)


def _lanes(events, device: str) -> dict:
    from agents.protocol import storage_lane

    reads = [e for e in events if e.kind == "io" and e.device == storage_lane(device)
             and (e.peer == "storage" or e.peer.endswith((" load", " preload")))]
    return {"storage_s": sum(e.end_s - e.start_s for e in reads), "reads": len(reads),
            "compute_s": sum(e.end_s - e.start_s for e in events if e.kind == "compute" and e.device == device)}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process has used."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _old_model(problem, plan, steps: int, cold_bps: float) -> dict:
    """The lanes the model before issue 26's fix predicted: one sequence, k(1-h) reads a step priced at
    the cold bandwidth with no fixed cost, a step's compute without its reads."""
    from core.techniques.expert_offload.cost import hit_rate

    m = problem.model
    reads = steps * m.layers * m.top_k * (1 - hit_rate(problem, plan))
    return {"storage_s": reads * m.expert_bytes / cold_bps, "reads": reads,
            "compute_s": steps * (m.layers * (m.layer_compute_s + m.top_k * m.expert_compute_s) + m.head_s)}


def prediction_scores(rounds: int = 3, tokens: int = 24) -> dict:
    """Predicted ÷ measured per lane on the demo's MoE and agents (module docstring)."""
    import statistics
    import tempfile

    from bench.sample_split import in_and_out_of_sample
    from core.devices.local_cluster import LocalCluster
    from core.models.demo_models import shipped
    from core.runs.coordinator import Coordinator
    from core.runs.generation import GenerationSettings, generate, load_tokenizer
    from core.techniques.expert_offload import TECHNIQUE
    from core.techniques.expert_offload.on_agents import cluster_problem, profile_agents, stored_bandwidth_bps
    from core.techniques.expert_offload.profiling import STORAGE_FILE
    from gui.demo_cluster import demo_emulation

    load_before = open("/proc/loadavg").read().split()[:3]
    devices = sorted({c[1] for c in PREDICTION_CONFIGS})
    with tempfile.TemporaryDirectory() as tmp:
        moe = Path(tmp) / "demo-moe"
        shutil.copytree(shipped("moe"), moe)
        emulation = demo_emulation(devices, shipped("llama"))
        cluster = LocalCluster(Path(tmp) / "cluster", devices, emulation=emulation)
        cluster.start()
        coordinator = Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=60.0)
        coordinator.open()
        try:
            coordinator.wait_ready(60.0)
            log("profiling the agents for the MoE and its storage (calibration)")
            profile = profile_agents(coordinator, moe, repeats=2)
            storage = json.loads((moe / STORAGE_FILE).read_text())
            tok = load_tokenizer(str(moe))
            rows, ratios, corrected = {}, {}, {}
            for name, device, share, prompts in PREDICTION_CONFIGS:
                problem = cluster_problem(profile, device, moe, bandwidth_bps=stored_bandwidth_bps(moe),
                                          expert_share=share)
                plan = TECHNIQUE.run_strategy(problem, "edgemoe", "latency").plan
                run_plan = TECHNIQUE.run_plan(plan, moe)
                prompt_tokens = max(len(ids) for ids in tok(list(prompts))["input_ids"])
                simulated = TECHNIQUE.simulate(problem, plan, generated_tokens=tokens, micro_batch_sizes=(len(prompts),),
                                               prompt_tokens=prompt_tokens).events
                predicted = _lanes(simulated, device)  # its "reads" count boxes (one per block): replaced below
                predicted["reads"] = sum(e.nbytes for e in simulated if e.kind == "io") / problem.model.expert_bytes
                old = _old_model(problem, plan, tokens, storage["bandwidth_bps"])
                measured, shares = [], []
                for _ in range(rounds):
                    sink = _Events()
                    cpu0, wall0 = _cpu_s(cluster.pid_of(device)), time.perf_counter()
                    generate(coordinator, run_plan, str(moe), list(prompts),
                             GenerationSettings(max_new_tokens=tokens, ignore_eos=True), sink=sink)
                    # the agent's CPU over the run's wall: ~1 on a quiet host, ~2/load on a loaded 2-core one;
                    # a slowed device's emulation sleeps out (slowdown - 1) x its CPU on purpose
                    cpu = (_cpu_s(cluster.pid_of(device)) - cpu0) * emulation[device].compute_slowdown
                    shares.append(min(1.0, cpu / (time.perf_counter() - wall0)))
                    measured.append(_lanes(sink.events, device))
                m = {k: statistics.median(r[k] for r in measured) for k in ("storage_s", "reads", "compute_s")}
                row = {"device": device, "experts_share": share, "prompts": len(prompts), "slots": plan.slots,
                       "preload": plan.preload, "measured": {k: round(v, 5) for k, v in m.items()},
                       "agent_cpu_share": round(statistics.median(shares), 3),
                       "predicted": {k: round(v, 5) for k, v in predicted.items()}}
                for lane in ("storage", "compute"):
                    key = f"{lane}_s"
                    row[f"{lane}_predicted_over_measured"] = round(predicted[key] / m[key], 3)
                    row[f"{lane}_old_model_over_measured"] = round(old[key] / m[key], 3)
                    ratios[f"{name}: {lane}"] = predicted[key] / m[key]
                    # what the lane would have taken with the agent on a core of its own (load removed, roughly)
                    corrected[f"{name}: {lane}"] = predicted[key] / (m[key] * statistics.median(shares))
                    row[f"{lane}_predicted_over_measured_cpu_share_corrected"] = round(corrected[f"{name}: {lane}"], 3)
                row["reads_predicted_over_measured"] = round(predicted["reads"] / m["reads"], 3)
                row["reads_old_model_over_measured"] = round(old["reads"] / m["reads"], 3)
                rows[name] = row
                log(f"{name}: {row}")
        finally:
            coordinator.close()
            cluster.stop()
    fitted = [f"{n}: {lane}" for n in IN_SAMPLE for lane in ("storage", "compute")]
    return {"model": "demo-moe (shipped): 4 blocks x 4 experts top-2", "new_tokens_each": tokens, "rounds": rounds,
            "storage_profile": {k: storage[k] for k in ("bandwidth_bps", "expert_bytes", "cold", "warm")},
            "configurations": rows, "scores": in_and_out_of_sample(ratios, fitted, tolerance=0.25),
            "scores_cpu_share_corrected": in_and_out_of_sample(corrected, fitted, tolerance=0.25),
            "loadavg_before": load_before, "loadavg_after": open("/proc/loadavg").read().split()[:3]}


def main() -> None:
    import tempfile

    if "--prediction-only" in sys.argv:
        torch.set_num_threads(1)
        print(json.dumps({"bench": "expert_offload", "prediction": prediction_scores()}))
        return

    torch.set_num_threads(1)
    model_dir = trained_model()
    train, held = held_out_split(fortune_lines())
    calibration, recall_text, ppl_text, prompt_text = train[:48], held[:24], held[24:24 + PPL_TEXTS], held[-6:]
    encoded = prompts(model_dir, prompt_text)

    def ids(lines):
        return [enc["input_ids"][0].tolist()[:32] for enc in prompts(model_dir, lines)]

    texts = ids(ppl_text)
    with tempfile.TemporaryDirectory() as tmp:
        log("activation profile")
        profiled, activations = build_profile(model_dir, Path(tmp), ids(calibration), ids(recall_text))
        in_sample_recall = profile_recall(profiled, ids(calibration))
        log(f"recall {activations['recall']} (on the calibration text itself: {in_sample_recall}); bit-width adaptation")
        adapted_dir, adapted = adaptation(profiled, texts)
        log(f"adapted: {adapted['options'][-1]}, perplexity {adapted['perplexity']}")
        qexp_dir = variant(profiled, "int4", {(b, e): 4 for b in range(RECIPE.layers) for e in range(RECIPE.experts)})
        whole = StageExecutor(str(profiled), 0, RECIPE.layers + 2)
        generate(whole, encoded[:1])  # warm-up: first-call costs are no configuration's
        model_bytes = whole.memory_bytes()
        probe = ExpertOffloadExecutor(str(profiled), 0, RECIPE.layers + 2, slots=1)
        probe.close()
        resident, expert = probe.resident_bytes(), probe.expert_bytes()
        qprobe = ExpertOffloadExecutor(str(qexp_dir), 0, RECIPE.layers + 2, slots=1)
        qprobe.close()
        q_expert = sum(t.numel() * t.element_size() for t in qprobe.store.read(0, 0))  # packed INT4 + scales
        aprobe = ExpertOffloadExecutor(str(adapted_dir), 0, RECIPE.layers + 2, slots=1)
        aprobe.close()
        a_expert = max(sum(t.numel() * t.element_size() for t in aprobe.store.read(b, e))
                       for b in range(RECIPE.layers) for e in range(RECIPE.experts))  # the largest, as stored
        rows, exact = [], True
        ref_tokens = None
        for fraction in BUDGETS:
            budget = int(fraction * model_bytes)
            slots = max(1, (budget - resident) // expert)
            q_slots = min(RECIPE.layers * RECIPE.experts, max(1, (budget - resident) // q_expert))
            # as many of the largest adapted expert as fit (mixed widths: the buffer never outgrows the budget)
            a_slots = min(RECIPE.layers * RECIPE.experts, max(1, int((budget - resident) // a_expert)))
            log(f"budget {fraction}: {slots} fp32 slots, {q_slots} INT4, {a_slots} adapted")
            tokens, free_tps = max((generate(whole, encoded) for _ in range(2)), key=lambda r: r[1])
            ref_tokens = ref_tokens or tokens
            row = {"budget_fraction": fraction, "budget_bytes": budget, "slots_fp32": int(slots),
                   "slots_int4": int(q_slots), "slots_adapted": int(a_slots),
                   "io_free": {"tokens_per_s": round(free_tps, 2), "peak_memory_bytes": model_bytes,
                               "within_budget": model_bytes <= budget}}
            configs = (("io_exp", profiled, slots, "lru", 0, False), ("edgemoe", profiled, slots, "edgemoe", 2, False),
                       ("lru_preload", profiled, slots, "lru", 2, False),
                       ("sti", profiled, slots, "lru", 0, True),
                       ("io_qexp", qexp_dir, q_slots, "lru", 0, False),
                       ("edgemoe_adapted", adapted_dir, a_slots, "edgemoe", 2, False))
            for name, directory, n, policy, preload, whole_layers in configs:
                tokens, figures = best_of(2, lambda: run_offloaded(directory, encoded, int(n), policy, preload,
                                                                   whole_layers))
                if directory == profiled:
                    exact = exact and tokens == ref_tokens
                figures["within_budget"] = figures["peak_memory_bytes"] <= budget
                row[name] = figures
            row["edgemoe_beats_io_exp"] = row["edgemoe"]["tokens_per_s"] > row["io_exp"]["tokens_per_s"]
            rows.append(row)
    print(json.dumps({
        "bench": "expert_offload", "model": "mixtral 4 blocks x 8 experts top-2, hidden 128, trained on the training split",
        "training": json.loads((model_dir / "training.json").read_text()).get("steps"),
        "model_bytes": model_bytes, "resident_bytes": resident, "expert_bytes": expert,
        "int4_expert_bytes": q_expert, "adapted_largest_expert_bytes": a_expert,
        "storage_bandwidth_bps": BANDWIDTH, "prompts": len(prompt_text), "new_tokens_each": TOKENS, "batch": 1,
        "tokens_equal_io_free": exact, "budgets": rows,
        "predictor_topk_recall_profile": activations["recall"],
        # the profile is calibrated on the calibration fortunes: its recall there is in sample, on the
        # held-out ones (never seen) out of sample
        "predictor_topk_recall": {"in_sample": in_sample_recall, "out_of_sample": activations["recall"],
                                  "calibrated_on": f"{len(calibration)} training fortunes",
                                  "scored_out_of_sample_on": f"{len(recall_text)} held-out fortunes"},
        "accuracy": {"metric": f"perplexity on {len(texts)} held-out fortunes (<= 32 tokens each; none in the "
                               f"model's {len(train)} training fortunes)",
                     "bound": ACCURACY_BOUND,
                     "perplexity": {k: round(v, 3) for k, v in adapted["perplexity"].items()},
                     "global_widths": [adapted["lower_bits"], adapted["upper_bits"]],
                     "experts_at_lower": adapted["low_experts"], "experts": adapted["experts"],
                     "adapted": adapted["options"][-1]["name"],
                     "avg_bits_per_expert_weight": round(adapted["options"][-1]["avg_bits"], 3),
                     "perplexity_evaluations": adapted["evaluations"]},
        "notes": "sti = whole next layer preloaded (no expert awareness), LRU; io_qexp: uniform INT4, on demand, "
                 "LRU, its buffer holds ~7x the experts (kept packed); edgemoe_adapted: EdgeMoE + the adapted experts, "
                 "as many slots as the largest of them fits; "
                 "edgemoe/io_exp/sti/lru_preload at full precision; best of 2 runs each",
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "prediction": prediction_scores(),
    }))


if __name__ == "__main__":
    main()
