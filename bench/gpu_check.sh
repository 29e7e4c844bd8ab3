#!/usr/bin/env bash
# Issue 28's GPU must-shows in one short script: one JSON line on stdout; each step is named on stderr as
# it starts, in this order:
#   1 sees:      what torch sees (CUDA, device name, memory) and what an agent reports (cuda_devices);
#   2 tokens:    a whole-model stage on the GPU (agents.shard.StageExecutor(torch_device="cuda:0")) vs
#                transformers' generate on the same GPU and vs the same stage on the CPU, greedy;
#   3 agent:     ONE AGENT PROCESS computing the whole model on the GPU (a 1-stage plan, Coordinator.run):
#                its decode tokens/s vs generate's on the same GPU (target >= 0.95x), tokens equal. Decode
#                rate = extra tokens / extra seconds between a run of N and of 2N new tokens (prefill cancels);
#   4 int8:      an int8 stage on the GPU vs torchao's quantized HF model (Int8WeightOnlyConfig) on that GPU;
#   5 profile:   the profiler's GPU unit times (agents.profiler.profile_units(device="cuda:0"), what
#                `edgeshard profile` writes into Profile.accelerator_times) vs the agent's measured decode step;
#   6 two_stage: a 2-stage plan run for real on 2 agent processes, stage 0 on the GPU, stage 1 on the CPU;
#   7 overlap:   that plan with 2 micro-batches, stage 0's outputs copied through pinned buffers on a side
#                stream and sent while it computes the next one (agents.boundary_copy), vs the same run with
#                EDGESHARD_COPY_OVERLAP=0 (each copy waited for before its send): tokens/s both ways, tokens equal.
# A step that fails records "<step>_error" (one line) and the next one still runs: one GPU session says all.
# Needs: torch built with CUDA (torch.version.cuda set) and the project's own dependencies importable
# (transformers, torchao, pyzmq, msgspec, safetensors; `pip install -c constraints.txt .` on a machine
# with the internet, torch==2.13.0 from the CUDA wheel index for the driver). It reaches nothing
# outside the machine: the model is generated here (a 6-block 512-wide llama, ~60 MB). Where torch or a
# dependency is missing, or torch sees no CUDA device, every step is listed as skipped with the reason and
# the script exits 0. Agents are started with the popen launcher (no fork after CUDA could be touched).
# Usage (repository root): bash bench/gpu_check.sh   (about 1-2 minutes on an H100; 300 s limit)
#        GPU_CHECK_DRY_RUN=1 GPU_CHECK_NEW_TOKENS=8 bash bench/gpu_check.sh   (every step on the CPU, fewer
#        tokens: checks the script itself; GPU_CHECK_TIMEOUT=S raises its limit on a busy CPU). Ended by its
#        limit, it still prints what it measured, with "timed_out_in_step".
set -uo pipefail
cd "$(dirname "$0")/.."
exec timeout "${GPU_CHECK_TIMEOUT:-300}" python3 - <<'PY'
import json, os, signal, sys, tempfile, time
from pathlib import Path

STEPS = (("sees", "what torch sees and what an agent reports"),
         ("tokens", "a whole-model GPU stage vs generate on the same GPU and vs the CPU stage (greedy)"),
         ("agent", "one agent process on the GPU: decode tokens/s vs generate's on the same GPU (>= 0.95x)"),
         ("int8", "an int8 GPU stage vs torchao's quantized HF model on the same GPU"),
         ("profile", "the profiler's GPU unit times vs the agent's measured decode step"),
         ("two_stage", "a 2-stage GPU+CPU plan on 2 agent processes vs generate"),
         ("overlap", "that plan, 2 micro-batches: copy/send overlapped vs waited (EDGESHARD_COPY_OVERLAP=0)"))
DRY = os.environ.get("GPU_CHECK_DRY_RUN") == "1"  # the whole script on the CPU: checks its own code where no GPU is
GPU = "cpu" if DRY else "cuda:0"
out = {"bench": "gpu_check", "dry_run_on_cpu": DRY}


def on_timeout(signum, frame):  # `timeout` ends it: what was measured so far still comes out, as one line
    out["timed_out_in_step"] = state_step[0]
    print(json.dumps(out), flush=True)
    os._exit(124)


state_step = [""]
signal.signal(signal.SIGTERM, on_timeout)


def say(i: int, what: str) -> None:
    print(f"gpu_check step {i}/{len(STEPS)} {STEPS[i - 1][0]}: {what}", file=sys.stderr, flush=True)


def skip_all(why: str) -> None:
    for i, (_, what) in enumerate(STEPS, 1):
        say(i, f"{what}: skipped, {why}")
    out["skipped"], out["note"] = [name for name, _ in STEPS], why
    print(json.dumps(out))
    sys.exit(0)


missing = []
for module in ("torch", "transformers", "torchao", "zmq", "msgspec", "safetensors"):
    try:
        __import__(module)
    except Exception as err:  # a missing or broken dependency: say which, do nothing else
        missing.append(f"{module} ({type(err).__name__})")
if missing:
    skip_all(f"cannot import {', '.join(missing)}: install torch with CUDA and the project's requirements")
import agents  # noqa: E402,F401  (quiets torchao's CPU-build log lines)
import torch  # noqa: E402

out.update({"cuda": torch.cuda.is_available(), "torch": torch.__version__, "torch_cuda": torch.version.cuda})
if not out["cuda"] and not DRY:
    skip_all(f"no CUDA: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}); "
             "GPU_CHECK_DRY_RUN=1 runs every step on the CPU")
sync = torch.cuda.synchronize if not DRY else (lambda: None)
os.environ["EDGESHARD_AGENT_LAUNCHER"] = "popen"

import transformers  # noqa: E402
from agents.shard import StageExecutor  # noqa: E402
from core.models.checkpoints import ModelRecipe, make_model  # noqa: E402

work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
model_dir = str(make_model(ModelRecipe(family="llama", layers=6, hidden=512, heads=8, kv_heads=4, vocab=4096,
                                       seed=7), work / "llama"))
NEW = int(os.environ.get("GPU_CHECK_NEW_TOKENS", "64"))  # a CPU dry run may take fewer
from core.runs.generation import load_tokenizer  # noqa: E402

tok = load_tokenizer(model_dir)  # left-padded, as runs take prompts
enc = tok(["The secret of life is"], return_tensors="pt")
PAIR = tok(["The secret of life is", "Love is"], return_tensors="pt", padding=True)
state = {}


def hf_tokens(model, new=NEW, batch=enc):
    ids = model.generate(**batch.to(GPU), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return ids[:, batch["input_ids"].shape[1]:].tolist()


def decode_rate(run):
    """Decode tokens/s of ``run(n)``: NEW more tokens over the extra seconds of 2*NEW vs NEW (prefill cancels)."""
    run(NEW)  # warm-up
    sync(); t0 = time.perf_counter(); first = run(NEW); sync(); t1 = time.perf_counter()
    run(2 * NEW); sync(); t2 = time.perf_counter()
    return first, NEW / max(1e-9, (t2 - t1) - (t1 - t0))


def stage_tokens(stage, new=NEW):
    ids, mask = enc["input_ids"].cpu(), enc["attention_mask"].cpu()
    token = stage.prefill(0, ids, mask).argmax(-1)[:, None]
    got = [int(token)]
    for _ in range(new - 1):
        token = stage.decode(0, token).argmax(-1)[:, None]
        got.append(int(token))
    stage.drop(0)
    return got


def run_request(batch, new, micro_batches=1, mode="sequential"):
    from core.runs.coordinator import RunRequest

    return RunRequest(input_ids=tuple(map(tuple, batch["input_ids"].tolist())),
                      attention_mask=tuple(map(tuple, batch["attention_mask"].tolist())), max_new_tokens=new,
                      mode=mode, micro_batches=micro_batches, eos_token_ids=(), pad_token_id=0)


def cluster(devices, name):
    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator

    c = LocalCluster(work / name, devices, startup_timeout_s=120)
    c.__enter__()
    co = Coordinator(c.endpoints, c.keys)
    co.__enter__()
    co.wait_ready(120)
    return c, co


def close(c, co):
    co.__exit__(None, None, None)
    c.__exit__(None, None, None)


def sees():
    if not DRY:
        props = torch.cuda.get_device_properties(0)
        out["device"], out["gpu_memory_gib"] = props.name, round(props.total_memory / 2**30, 1)
    from agents.accelerators import cuda_devices
    out["agent_reports"] = [n for n, _, _ in cuda_devices()]


def tokens():
    state["hf"] = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval().to(GPU)
    state["reference"] = hf_tokens(state["hf"])[0]
    got = stage_tokens(StageExecutor(model_dir, 0, 8, torch_device=GPU))
    out["gpu_stage_tokens_equal_hf_generate"] = got == state["reference"]
    out["gpu_stage_tokens_equal_cpu_stage"] = got == stage_tokens(StageExecutor(model_dir, 0, 8))


def agent():
    from core.planning.plan import plan_from_boundaries

    _, hf_rate = decode_rate(lambda n: hf_tokens(state["hf"], n))
    plan = plan_from_boundaries("llama", 8, ["edge-gpu"], [])
    c, co = cluster(["edge-gpu"], "one")
    try:
        out["agent_accelerators"] = [a.name for a in co.status()["edge-gpu"].accelerators]
        co.load(plan, model_dir, timeout_s=120, torch_devices={"edge-gpu": GPU})
        got, rate = decode_rate(lambda n: list(co.run(plan, run_request(enc, n)).tokens[0]))
    finally:
        close(c, co)
    state["agent_rate"] = rate
    out["hf_generate_gpu_decode_tokens_s"] = round(hf_rate, 1)
    out["agent_gpu_decode_tokens_s"] = round(rate, 1)
    out["agent_over_hf_generate"] = round(rate / hf_rate, 3)
    out["agent_gpu_tokens_equal_hf_generate"] = got == state["reference"]


def int8():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval().to(GPU)
    quantize_(model.model.layers, Int8WeightOnlyConfig())
    got = stage_tokens(StageExecutor(model_dir, 0, 8, torch_device=GPU, weights="int8"))
    out["int8_gpu_stage_tokens_equal_torchao_hf"] = got == hf_tokens(model)[0]


def profile():
    from agents.profiler import profile_units
    from agents.protocol import ComputeOptions

    config = json.loads(Path(model_dir, "config.json").read_text())
    prompt = int(enc["input_ids"].shape[1])
    units = profile_units(ComputeOptions(config=config, prompt_tokens=prompt, batch_sizes=(1,), repeats=7,
                                         context_tokens=prompt + NEW, device=GPU))
    predicted = sum(u.decode_s[0] for u in units.units) + units.stage_decode_overhead_s
    measured = 1.0 / state["agent_rate"]
    out["profile_gpu_decode_step_ms"] = round(predicted * 1e3, 3)
    out["agent_measured_gpu_decode_step_ms"] = round(measured * 1e3, 3)
    out["profile_over_measured"] = round(predicted / measured, 3)


def two_stage_run(overlap: bool, micro_batches: int, batch):
    from core.planning.plan import plan_from_boundaries

    os.environ["EDGESHARD_COPY_OVERLAP"] = "1" if overlap else "0"  # read by each agent's run
    plan = plan_from_boundaries("llama", 8, ["edge-gpu", "edge-cpu"], [4])
    c, co = cluster(["edge-gpu", "edge-cpu"], f"two-{overlap}-{micro_batches}")
    try:
        co.load(plan, model_dir, timeout_s=120, torch_devices={"edge-gpu": GPU, "edge-cpu": "cpu"})
        mode = "sequential" if micro_batches == 1 else "no-bubbles"
        request = run_request(batch, NEW, micro_batches, mode)
        co.run(plan, request)  # warm-up
        t0 = time.perf_counter()
        got = [list(t) for t in co.run(plan, request).tokens]
        return got, NEW * len(got) / (time.perf_counter() - t0)
    finally:
        close(c, co)


def two_stage():
    got, rate = two_stage_run(True, 1, enc)
    out["two_stage_gpu_cpu_tokens_s"] = round(rate, 1)
    out["two_stage_gpu_cpu_tokens_equal_hf_generate"] = got[0] == state["reference"]


def overlap():
    reference = hf_tokens(state["hf"], NEW, PAIR)
    rates = {}
    for on in (True, False):
        got, rates[on] = two_stage_run(on, 2, PAIR)
        out[f"overlap_{'on' if on else 'off'}_tokens_equal_hf_generate"] = got == reference
    out["overlap_on_tokens_s"], out["overlap_off_tokens_s"] = round(rates[True], 1), round(rates[False], 1)
    out["overlap_on_over_off"] = round(rates[True] / rates[False], 3)


for i, (name, what) in enumerate(STEPS, 1):
    say(i, what)
    state_step[0] = name
    t_step = time.perf_counter()
    try:
        globals()[name]()
    except Exception as err:  # the next step still runs: one GPU session reports everything it can
        out[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        print(f"gpu_check step {i}/{len(STEPS)} {name}: FAILED {out[f'{name}_error']}", file=sys.stderr, flush=True)
    out.setdefault("step_s", {})[name] = round(time.perf_counter() - t_step, 1)
print(json.dumps(out))
PY
