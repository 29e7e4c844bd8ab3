#!/usr/bin/env bash
# The one short check a session with a GPU machine runs for issue 28 (one JSON line on stdout):
#   - what torch sees (CUDA, device name, memory) and what an agent reports (AgentStatus.accelerators);
#   - tokens: a whole-model stage on the GPU (agents.shard.StageExecutor(torch_device="cuda")) vs
#     transformers' generate on the same GPU, greedy, and vs the same stage on the CPU;
#   - decode tokens/s of that stage vs generate's on the same GPU (target >= 0.95x), batch 1;
#   - a 2-stage plan run for real on 2 local agent processes, stage 0 on the GPU, stage 1 on the CPU
#     (Coordinator.load(torch_devices=...)), its tokens vs generate's.
# Written and tested on a CPU-only machine (the CUDA path of StageExecutor is unexercised there):
# if a figure is wrong on the GPU, this script is the first place that says so.
# Usage (repository root): bash bench/gpu_check.sh   (about a minute; exits 0 when it could report)
#        GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh   (every step on the CPU: checks the script itself;
#        GPU_CHECK_TIMEOUT=S raises its 300 s limit on a busy CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout "${GPU_CHECK_TIMEOUT:-300}" python3 - <<'PY'
import json, sys, tempfile, time
from pathlib import Path

import agents  # noqa: F401  (quiets torchao's CPU-build log lines)
import torch

import os

DRY = os.environ.get("GPU_CHECK_DRY_RUN") == "1"  # the whole script on the CPU: checks its own code where no GPU is
GPU = "cpu" if DRY else "cuda"
out = {"bench": "gpu_check", "cuda": torch.cuda.is_available(), "torch": torch.__version__, "dry_run_on_cpu": DRY}
if not out["cuda"] and not DRY:
    out["note"] = "no CUDA device visible to torch: nothing to time (GPU_CHECK_DRY_RUN=1 runs it all on the CPU)"
    print(json.dumps(out))
    sys.exit(0)
if not DRY:
    props = torch.cuda.get_device_properties(0)
    out["device"], out["gpu_memory_gib"] = props.name, round(props.total_memory / 2**30, 1)
sync = torch.cuda.synchronize if not DRY else (lambda: None)

import transformers
from agents.shard import StageExecutor
from core.models.checkpoints import ModelRecipe, make_model

work = Path(tempfile.mkdtemp())
model_dir = str(make_model(ModelRecipe(family="llama", layers=6, hidden=512, heads=8, kv_heads=4, vocab=4096,
                                       seed=7), work / "llama"))
new = 64
tok = transformers.AutoTokenizer.from_pretrained(model_dir)
enc = tok(["The secret of life is"], return_tensors="pt")
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval().to(GPU)


def hf_tokens():
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


reference, out["hf_generate_gpu_tokens_s"] = timed(hf_tokens)
gpu_stage = StageExecutor(model_dir, 0, 8, torch_device=GPU)
got, out["agent_stage_gpu_tokens_s"] = timed(lambda: stage_tokens(gpu_stage))
out["agent_over_hf_generate"] = round(out["agent_stage_gpu_tokens_s"] / out["hf_generate_gpu_tokens_s"], 3)
out["gpu_stage_tokens_equal_hf_generate"] = got == reference
out["gpu_stage_tokens_equal_cpu_stage"] = got == stage_tokens(StageExecutor(model_dir, 0, 8))

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
    tokens = list(co.run(plan, request).tokens[0])
    out["two_stage_gpu_cpu_tokens_s"] = round(new / (time.perf_counter() - t0), 1)
    out["two_stage_gpu_cpu_tokens_equal_hf_generate"] = tokens == reference
print(json.dumps(out))
PY
