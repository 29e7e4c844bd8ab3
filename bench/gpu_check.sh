#!/usr/bin/env bash
# The one short check a session with a GPU machine runs for issue 28 (one JSON line on stdout; each step
# is named on stderr as it starts, in this order):
#   1 sees:      what torch sees (CUDA, device name, memory) and what an agent reports (AgentStatus.accelerators);
#   2 tokens:    a whole-model stage on the GPU (agents.shard.StageExecutor(torch_device="cuda")) vs
#                transformers' generate on the same GPU, greedy, and vs the same stage on the CPU;
#   3 speed:     decode tokens/s of that stage vs generate's on the same GPU (target >= 0.95x), batch 1;
#   4 int8:      an int8 stage on the GPU vs torchao's quantized HF model (Int8WeightOnlyConfig) on that GPU;
#   5 profile:   the profiler's GPU unit times (agents.profiler.profile_units(device="cuda:0"), what
#                `edgeshard profile` writes into Profile.accelerator_times) vs the stage's measured decode step;
#   6 two_stage: a 2-stage plan run for real on 2 local agent processes, stage 0 on the GPU, stage 1 on the
#                CPU (Coordinator.load(torch_devices=...)), its tokens vs generate's.
# A step that fails records "<step>_error" (one line) and the next one still runs: one GPU session says all.
# Written and tested on a CPU-only machine (the CUDA path of StageExecutor is unexercised there): where torch
# sees no CUDA device every step is listed as skipped ("no CUDA") and the script exits 0.
# Usage (repository root): bash bench/gpu_check.sh   (about a minute on a GPU)
#        GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh   (every step on the CPU: checks the script itself;
#        GPU_CHECK_TIMEOUT=S raises its 300 s limit on a busy CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout "${GPU_CHECK_TIMEOUT:-300}" python3 - <<'PY'
import json, os, sys, tempfile, time
from pathlib import Path

import agents  # noqa: F401  (quiets torchao's CPU-build log lines)
import torch

STEPS = (("sees", "what torch sees and what an agent reports"),
         ("tokens", "a whole-model GPU stage vs generate on the same GPU and vs the CPU stage (greedy)"),
         ("speed", "decode tokens/s of that stage vs generate's on the same GPU (target >= 0.95x)"),
         ("int8", "an int8 GPU stage vs torchao's quantized HF model on the same GPU"),
         ("profile", "the profiler's GPU unit times vs the GPU stage's measured decode step"),
         ("two_stage", "a 2-stage GPU+CPU plan on 2 agent processes vs generate"))
DRY = os.environ.get("GPU_CHECK_DRY_RUN") == "1"  # the whole script on the CPU: checks its own code where no GPU is
GPU = "cpu" if DRY else "cuda:0"
out = {"bench": "gpu_check", "cuda": torch.cuda.is_available(), "torch": torch.__version__, "dry_run_on_cpu": DRY}


def say(i: int, what: str) -> None:
    print(f"gpu_check step {i}/{len(STEPS)} {STEPS[i - 1][0]}: {what}", file=sys.stderr, flush=True)


if not out["cuda"] and not DRY:
    why = f"no CUDA: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})"
    for i, (_, what) in enumerate(STEPS, 1):
        say(i, f"{what}: skipped, {why}")
    out["skipped"], out["note"] = [name for name, _ in STEPS], why + "; GPU_CHECK_DRY_RUN=1 runs every step on the CPU"
    print(json.dumps(out))
    sys.exit(0)
sync = (lambda: torch.cuda.synchronize()) if not DRY else (lambda: None)

import transformers
from agents.shard import StageExecutor
from core.models.checkpoints import ModelRecipe, make_model

work = Path(tempfile.mkdtemp())
model_dir = str(make_model(ModelRecipe(family="llama", layers=6, hidden=512, heads=8, kv_heads=4, vocab=4096,
                                       seed=7), work / "llama"))
new = 64
tok = transformers.AutoTokenizer.from_pretrained(model_dir)
enc = tok(["The secret of life is"], return_tensors="pt")
state = {}


def hf_tokens(model):
    ids = model.generate(**enc.to(GPU), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return ids[0, enc["input_ids"].shape[1]:].tolist()


def stage_tokens(stage):
    ids, mask = enc["input_ids"].cpu(), enc["attention_mask"].cpu()
    token = stage.prefill(0, ids, mask).argmax(-1)[:, None]
    got = [int(token)]
    for _ in range(new - 1):
        token = stage.decode(0, token).argmax(-1)[:, None]
        got.append(int(token))
    stage.drop(0)
    return got


def timed(fn):
    fn()  # warm-up
    sync(); t0 = time.perf_counter()
    result = fn()
    sync()
    return result, new / (time.perf_counter() - t0)


def sees():
    if not DRY:
        props = torch.cuda.get_device_properties(0)
        out["device"], out["gpu_memory_gib"] = props.name, round(props.total_memory / 2**30, 1)
    from agents.accelerators import cuda_devices
    out["agent_reports"] = [n for n, _, _ in cuda_devices()]


def tokens():
    state["hf"] = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval().to(GPU)
    state["reference"], state["hf_tokens_s"] = timed(lambda: hf_tokens(state["hf"]))
    state["stage"] = StageExecutor(model_dir, 0, 8, torch_device=GPU)
    got, state["stage_tokens_s"] = timed(lambda: stage_tokens(state["stage"]))
    out["gpu_stage_tokens_equal_hf_generate"] = got == state["reference"]
    out["gpu_stage_tokens_equal_cpu_stage"] = got == stage_tokens(StageExecutor(model_dir, 0, 8))


def speed():
    out["hf_generate_gpu_tokens_s"] = round(state["hf_tokens_s"], 1)
    out["agent_stage_gpu_tokens_s"] = round(state["stage_tokens_s"], 1)
    out["agent_over_hf_generate"] = round(state["stage_tokens_s"] / state["hf_tokens_s"], 3)


def int8():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval().to(GPU)
    quantize_(model.model.layers, Int8WeightOnlyConfig())
    got = stage_tokens(StageExecutor(model_dir, 0, 8, torch_device=GPU, weights="int8"))
    out["int8_gpu_stage_tokens_equal_torchao_hf"] = got == hf_tokens(model)


def profile():
    from agents.profiler import profile_units
    from agents.protocol import ComputeOptions

    config = json.loads(Path(model_dir, "config.json").read_text())
    prompt = int(enc["input_ids"].shape[1])
    units = profile_units(ComputeOptions(config=config, prompt_tokens=prompt, batch_sizes=(1,), repeats=7,
                                         context_tokens=prompt + new // 2, device=GPU))
    predicted = sum(u.decode_s[0] for u in units.units) + units.stage_decode_overhead_s
    measured = 1.0 / state["stage_tokens_s"]
    out["profile_gpu_decode_step_ms"] = round(predicted * 1e3, 3)
    out["measured_gpu_decode_step_ms"] = round(measured * 1e3, 3)
    out["profile_over_measured"] = round(predicted / measured, 3)


def two_stage():
    from core.devices.local_cluster import LocalCluster
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import Coordinator, RunRequest

    plan = plan_from_boundaries("llama", 8, ["edge-gpu", "edge-cpu"], [4])
    with LocalCluster(work / "agents", ["edge-gpu", "edge-cpu"]) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as co:
        co.wait_ready(60)
        out["agent_accelerators"] = {d: [a.name for a in st.accelerators] for d, st in co.status().items()}
        co.load(plan, model_dir, timeout_s=120, torch_devices={"edge-gpu": GPU, "edge-cpu": "cpu"})
        request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                             attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())), max_new_tokens=new,
                             mode="sequential", micro_batches=1, eos_token_ids=(), pad_token_id=0)
        t0 = time.perf_counter()
        got = list(co.run(plan, request).tokens[0])
        out["two_stage_gpu_cpu_tokens_s"] = round(new / (time.perf_counter() - t0), 1)
        out["two_stage_gpu_cpu_tokens_equal_hf_generate"] = got == state["reference"]


for i, (name, what) in enumerate(STEPS, 1):
    say(i, what)
    try:
        globals()[name]()
    except Exception as err:  # the next step still runs: one GPU session reports everything it can
        out[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        print(f"gpu_check step {i}/{len(STEPS)} {name}: FAILED {out[f'{name}_error']}", file=sys.stderr, flush=True)
print(json.dumps(out))
PY
