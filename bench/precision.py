"""Weight precision of layer-sharding stages (int8 / int4, quantized at load by torchao): one JSON line.

- ``tokens_equal``: greedy tokens of 2 agent processes (a local cluster) with every stage at int8 /
  int4 vs transformers' ``generate`` on the same HF model quantized in-process by torchao's
  ``quantize_`` on its decoder blocks (agents/weight_precision.py's configs, written out here);
- ``perplexity``: fp32 / int8 / int4 on held-out text (the demo's quotations, every 10th line never
  trained on: ``core.models.training.held_out_split``; a generated model's is near its vocabulary
  size: only the ratios between precisions say something there);
- ``weight_bytes_over_fp32``: bytes a whole-model stage holds after load / fp32's (and the
  blocks-only ratio, ``blocks_bytes_over_fp32``: the embedding and head stay fp32);
- ``decode_tokens_s_over_fp32``: one process, one whole-model stage per precision, decode steps
  interleaved round by round (load stated: a 2-core shared host);
- ``mixed_plan``: a plan mixing int8 (first half of the blocks) and int4 (second half), its own held-out
  perplexity (torchao's in-process model of that mix) beside the worst precision's rise, the bound a
  planner checks a mixed plan against;
- ``agent_rss_mib``: each agent's RSS after loading its stage at each precision;
- ``four_bit_only_plan_ran``: 2 local agents with an emulated memory budget between the int4 and
  int8 stage sizes: the fp32 and int8 plans are refused at load (``ShardOverBudget``), the int4 plan
  loads and runs, its tokens equal the in-process int4 model's.

Model: ``--model DIR`` (e.g. the trained demo model), else the demo's recipe generated with random
weights; ``--large`` adds a generated llama of >= 300 MB fp32 (every figure, its agent runs
``--large-max-new-tokens`` long). ``int8_kernel_paths``: one batch-1 linear through each int8 path
(why int8 weight-only decode is not faster on this CPU).

Usage: python bench/precision.py [--model DIR] [--large] [--decode-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRECISIONS = ("int8", "int4")
PROMPTS = ["The secret of life is", "A wise man once said", "Love is"]
DEMO_RECIPE = dict(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7)
LARGE_RECIPE = dict(family="llama", layers=6, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=8192,
                    seed=5)
"""~330 MB of fp32 weights."""


def reference_configs():
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig

    return {"int8": Int8WeightOnlyConfig(),
            "int4": PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False)}


def hf_model(model_dir: str, weights: str):
    import transformers
    from torchao.quantization import quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if weights != "fp":
        quantize_(model.model.layers, reference_configs()[weights])
    return model


def hf_greedy(model_dir: str, weights: str, enc, max_new: int) -> list[list[int]]:
    out = hf_model(model_dir, weights).generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                                                eos_token_id=2)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        rows.append(row[:row.index(2) + 1] if 2 in row else row)
    return rows


def mixed_hf_model(model_dir: str, split: int):
    """torchao's in-process model of a plan mixing precisions: blocks [0, split) int8, the rest int4 (what
    two agents' stages at those precisions compute: their tokens equal it, tests/core/runs)."""
    import transformers
    from torchao.quantization import quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for i, layer in enumerate(model.model.layers):
        quantize_(layer, reference_configs()["int8" if i < split else "int4"])
    return model


def mixed_plan_perplexity(model_dir: str, lines: list[str], single: dict) -> dict:
    """A plan mixing int8 (first half of the blocks) and int4 (second half): its own perplexity beside the
    bound the planner checks it against (each precision's whole-model rise; the mix's is assumed no worse
    than its worst precision's, docs/model-shards.md)."""
    layers = int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])
    split = layers // 2
    mixed = perplexity(model_dir, "mixed", lines, model=mixed_hf_model(model_dir, split))
    rise = {w: single[w] / single["fp32"] - 1 for w in PRECISIONS}
    own = mixed / single["fp32"] - 1
    return {"plan": f"blocks 1-{split} int8, {split + 1}-{layers} int4", "perplexity": round(mixed, 3),
            "rise_over_fp32": round(own, 6), "worst_precision_rise_over_fp32": round(max(rise.values()), 6),
            "within_worst_precision_bound": own <= max(rise.values()) + 1e-12}


def perplexity(model_dir: str, weights: str, lines: list[str], model=None) -> float:
    import torch

    from core.runs.generation import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = model if model is not None else hf_model(model_dir, weights)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for line in lines:
            ids = tok(line, return_tensors="pt")["input_ids"]
            if ids.shape[1] < 2:
                continue
            loss = model(input_ids=ids, labels=ids).loss
            nll += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(nll / count)


def held_out_lines(limit: int) -> tuple[list[str], str]:
    from core.models.training import fortune_lines, held_out_split

    try:
        _, held = held_out_split(fortune_lines())
    except Exception as err:  # the fortunes package missing: generated text instead
        return [" ".join(PROMPTS)] * 4, f"no quotation corpus ({type(err).__name__})"
    return held[:limit], "fortunes held-out quotations"


def stage_bytes(model_dir: str) -> dict:
    from agents.shard import StageExecutor

    units = int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]) + 2
    whole = {w: StageExecutor(model_dir, 0, units, weights=w).memory_bytes() for w in ("fp", *PRECISIONS)}
    blocks = {w: StageExecutor(model_dir, 1, units - 1, weights=w).memory_bytes() for w in ("fp", *PRECISIONS)}
    return {"fp32_bytes": whole["fp"],
            "weight_bytes_over_fp32": {w: round(whole[w] / whole["fp"], 4) for w in PRECISIONS},
            "blocks_bytes_over_fp32": {w: round(blocks[w] / blocks["fp"], 4) for w in PRECISIONS}}


def decode_speed(model_dir: str, tokens: int, rounds: int) -> dict:
    """Decode tokens/s of one whole-model stage per precision, batch 1, rounds interleaved."""
    import torch

    from agents.shard import StageExecutor
    from core.runs.generation import load_tokenizer

    torch.set_num_threads(1)
    units = int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]) + 2
    stages = {w: StageExecutor(model_dir, 0, units, weights=w) for w in ("fp", *PRECISIONS)}
    enc = load_tokenizer(model_dir)(PROMPTS[:1], return_tensors="pt")
    best = {w: math.inf for w in stages}
    for _ in range(rounds):
        for w, stage in stages.items():
            logits = stage.prefill(0, enc["input_ids"], enc["attention_mask"])
            token = logits.argmax(-1)[:, None]
            t0 = time.perf_counter()
            for _ in range(tokens):
                token = stage.decode(0, token).argmax(-1)[:, None]
            best[w] = min(best[w], time.perf_counter() - t0)
            stage.drop(0)
    tps = {w: tokens / s for w, s in best.items()}
    return {"decode_tokens_s": {("fp32" if w == "fp" else w): round(v, 1) for w, v in tps.items()},
            "decode_tokens_s_over_fp32": {w: round(tps[w] / tps["fp"], 3) for w in PRECISIONS}}


def int8_kernel_paths(rows: int = 2816, cols: int = 1024, calls: int = 200) -> dict:
    """Why int8 weight-only decode is not faster here: one batch-1 linear of a (rows x cols) weight,
    microseconds per call, through fp32 ``F.linear``, torchao's ``Int8Tensor`` (what a stage runs),
    torch's own int8 kernel ``_weight_int8pack_mm`` (reads 1 byte a weight) and an explicit
    dequantize-then-matmul (what ``Int8Tensor`` does inside: ``qdata.t().to(dtype)`` then ``mm``)."""
    import torch
    from torch import nn
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.set_num_threads(1)
    torch.manual_seed(0)
    fp = nn.Linear(cols, rows, bias=False)
    q = nn.Linear(cols, rows, bias=False)
    q.weight.data.copy_(fp.weight.data)
    quantize_(q, Int8WeightOnlyConfig())
    x = torch.randn(1, cols)
    w8 = torch.randint(-128, 127, (rows, cols), dtype=torch.int8)
    scales = torch.rand(rows)

    def per_call(fn) -> float:
        with torch.inference_mode():
            for _ in range(10):
                fn()
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, time.perf_counter() - t0)
        return round(best / calls * 1e6, 1)

    return {"shape": [rows, cols], "fp32_linear_us": per_call(lambda: fp(x)),
            "torchao_int8_tensor_us": per_call(lambda: q(x)),
            "torch_weight_int8pack_mm_us": per_call(lambda: torch._weight_int8pack_mm(x, w8, scales)),
            "dequantize_then_mm_us": per_call(lambda: x @ (w8.to(torch.float32) * scales[:, None]).t())}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def wait_not_loading(co, devices, timeout_s: float = 60.0) -> None:
    from agents.protocol import AgentState

    deadline = time.monotonic() + timeout_s
    while any(st.state is AgentState.LOADING for st in co.status().values()) and time.monotonic() < deadline:
        time.sleep(0.05)


def agents_figures(model_dir: str, max_new: int, workdir: Path) -> dict:
    """tokens_equal and agent RSS over 2 agent processes, then the 4-bit-only plan on budgeted agents."""
    from agents.emulation import DeviceEmulation
    from core.devices.local_cluster import LocalCluster
    from core.errors import ShardOverBudget
    from core.models.units import load_model_spec
    from core.planning.plan import plan_from_boundaries, with_weights
    from core.planning.precision import stage_weight_bytes
    from core.runs.coordinator import Coordinator
    from core.runs.generation import GenerationSettings, generate, load_tokenizer

    spec = load_model_spec(model_dir, "fp32")
    n = spec.num_units
    devices = ["edge-a", "edge-b"]
    base = plan_from_boundaries(Path(model_dir).name, n, devices, [n // 2])
    enc = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    settings = GenerationSettings(max_new_tokens=max_new)

    def tokens(co, plan):
        out = generate(co, plan, model_dir, PROMPTS, settings)
        return [list(t) for t in out.result.tokens]

    equal, rss = {}, {}
    with LocalCluster(workdir / "agents", devices) as cluster, Coordinator(cluster.endpoints, cluster.keys) as co:
        co.wait_ready(60)
        for w in ("fp", *PRECISIONS):
            plan = with_weights(base, w)
            got = tokens(co, plan)
            rss["fp32" if w == "fp" else w] = {d: rss_mib(cluster.pid_of(d)) for d in devices}
            if w != "fp":
                equal[w] = got == hf_greedy(model_dir, w, enc, max_new)
    # the plan that fits only at 4 bits: each device's budget is its stage's int4 weights and the KV cache the
    # run reserves, plus half the int8-int4 difference (the agent checks exactly these bytes at load)
    context = int(enc["input_ids"].shape[1]) + max_new
    sizes = {w: [stage_weight_bytes(spec, s.start, s.end, w) for s in base.stages] for w in ("fp", *PRECISIONS)}
    kv = [sum(u.kv_bytes_per_token for u in spec.units[s.start:s.end]) * len(PROMPTS) * context for s in base.stages]
    budgets = [i4 + k + (i8 - i4) // 2 for i4, i8, k in zip(sizes["int4"], sizes["int8"], kv)]
    budgeted = {d: DeviceEmulation(memory_budget_bytes=b) for d, b in zip(devices, budgets)}
    ran = {"budget_bytes": budgets, "stage_bytes": sizes, "kv_bytes": kv}
    with LocalCluster(workdir / "budgeted", devices, emulation=budgeted) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as co:
        co.wait_ready(60)
        for w in ("fp", "int8"):
            try:
                tokens(co, with_weights(base, w))
                ran[f"{w}_refused"] = False
            except ShardOverBudget:
                ran[f"{w}_refused"] = True
            wait_not_loading(co, devices)  # the other stage of a refused plan may still be loading
        got = tokens(co, with_weights(base, "int4"))
        ran["int4_tokens_equal"] = got == hf_greedy(model_dir, "int4", enc, max_new)
    ran["ran"] = ran["fp_refused"] and ran["int8_refused"] and ran["int4_tokens_equal"]
    return {"tokens_equal": equal, "agent_rss_mib": rss, "four_bit_only_plan_ran": ran}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint folder (default: the demo recipe, generated)")
    ap.add_argument("--large", action="store_true", help="also a generated llama of >= 300 MB fp32")
    ap.add_argument("--large-only", action="store_true", help="the large model alone (its figures at the top level)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--held-out-lines", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--large-max-new-tokens", type=int, default=4, help="tokens of the large model's agent runs")
    args = ap.parse_args()

    import agents  # noqa: F401  (quiets torchao's CUDA-library lines before transformers imports it)
    from core.models.checkpoints import ModelRecipe, make_model

    work = Path(tempfile.mkdtemp(prefix="precision-bench-"))
    lines, corpus = held_out_lines(args.held_out_lines)
    result: dict = {"bench": "precision", "torchao": __import__("torchao").__version__,
                    "load_1min_before": os.getloadavg()[0]}
    if not args.large_only:
        model_dir = args.model or str(make_model(ModelRecipe(**DEMO_RECIPE), work / "demo-llama"))
        result.update({"model": Path(model_dir).name, "generated": not args.model})
        result.update(agents_figures(model_dir, args.max_new_tokens, work))
        result["perplexity"] = {("fp32" if w == "fp" else w): round(perplexity(model_dir, w, lines), 3)
                                for w in ("fp", *PRECISIONS)}
        result["perplexity_text"] = f"{corpus}, {len(lines)} lines"
        result["mixed_plan"] = mixed_plan_perplexity(model_dir, lines, result["perplexity"])
        result.update(stage_bytes(model_dir))
        result.update(decode_speed(model_dir, args.decode_tokens, args.rounds))
        result["int8_kernel_paths"] = int8_kernel_paths()
    if args.large or args.large_only:
        large = str(make_model(ModelRecipe(**LARGE_RECIPE), work / "large-llama"))
        figures = {**agents_figures(large, args.large_max_new_tokens, work / "large"),
                   **stage_bytes(large), **decode_speed(large, args.decode_tokens, args.rounds)}
        figures["perplexity"] = {("fp32" if w == "fp" else w): round(perplexity(large, w, lines[:50]), 3)
                                 for w in ("fp", *PRECISIONS)}
        figures["perplexity_text"] = f"{corpus}, {min(50, len(lines))} lines"
        figures["mixed_plan"] = mixed_plan_perplexity(large, lines[:50], figures["perplexity"])
        if args.large_only:
            result.update({"model": "large-llama (generated)", **figures})
        else:
            result["large"] = figures
    result["load_1min_after"] = os.getloadavg()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
