"""Benchmark the partitioned runtime side by side in one run; prints one JSON line.

Model: the generated ≈170 M-parameter Llama of ``core.models.checkpoints.BENCHMARK_RECIPE``
(made once into ``--model`` if missing). Figures (targets from issue 3):

- ``agent_vs_hf``: decode tokens/s of a 1-stage agent over an in-process HF forward loop
  with a KV cache (same thread count), target >= 0.95;
- ``four_vs_one``: 4 stages on loopback, sequential, over 1 stage, target >= 0.90;
- ``hop_us``: one hop of a 1x4096 fp32 activation between two processes through this
  project's framing (PUSH/PULL, header + raw tensor frame, strict decode), with and
  without CurveZMQ: half the median round trip;
- ``nobubbles_vs_bubbles``: decode throughput with 2 stages and 4 micro-batches (ideal
  (M+S−1)/M = 1.25); with ``--three-by-three`` also 3 stages × 3 micro-batches (ideal 5/3,
  needs a core per stage: on 2 shared cores the third stage waits for a core).

A hop inside the runtime three ways: ``runtime_hop_us_median`` (send start on one stage to
compute start on the next, across the coordinator's clock estimates, so it carries their
error: the estimates of agents on one host differ by up to ~0.1 ms although their clocks are
the same); ``runtime_hop_us_from_steps`` (offset-free: per decode step, the token gap at the
source less the stages' compute, 4 stages less 1 stage, over 4 hops); ``hop_split_us_median``
(the parts one agent's clock times: framing before the send, the send call, receive to
compute; the rest of a hop is libzmq's IO threads, CurveZMQ, TCP and the wake-ups).
``step_compute_ms_per_stage``: median decode compute per step of each stage (solo = 1 stage).

All agents live at once (a solo agent, a 4-stage and a 2-stage plan, on disjoint
agents) and the configurations are measured in interleaved rounds, so drift in the
machine's load hits all of them alike. On a machine shared with other work the wall
times swing 2x from round to round, so besides medians of the per-round rates the bench
reports ``*_quiet`` ratios from the 10th percentile of per-token gaps (the speed when the
process got the cores), ``*_cpu`` ratios from CPU seconds per generated token (HF:
the computing thread's CPU time; agents: user+system time of the agent processes over the
run, every thread included — the most load-independent measure of the runtime's own
cost), and the 1-minute load average before and after. Every agent and the HF baseline
get ``--threads`` torch threads (default 1); the pipelined 2-stage plan gets half of them,
at least 1 (``bench/investigations/omp_wait.py`` compares 1 and 2 threads and OpenMP's wait policies).

Usage: python bench/runtime.py [--model DIR] [--rounds 5] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from agents.protocol import DataHeader
from agents.transport import (
    DATA_DOMAIN,
    CurveKeys,
    KeyGate,
    curve_client,
    curve_server,
    data_message,
    start_authenticator,
    tensor_frame,
    tensor_from_frame,
)

PROMPT_TOKENS = 16


# ------------------------------------------------------------------------- per hop
def _echo(port_in: int, port_out: int, curve: str) -> None:
    """Child process: receive a data message, decode it strictly, send it back."""
    from agents.protocol import decode_data

    ctx = zmq.Context()
    keys = None
    if curve:
        server_pub, my_pub, my_sec = curve.split(",")
        keys = CurveKeys(my_pub, my_sec)
        gate = KeyGate()
        gate.allow(DATA_DOMAIN, [server_pub])
        auth = start_authenticator(ctx, gate)
    pull = ctx.socket(zmq.PULL)
    curve_server(pull, keys, DATA_DOMAIN)
    pull.bind(f"tcp://127.0.0.1:{port_in}")
    push = ctx.socket(zmq.PUSH)
    curve_client(push, keys, server_pub if curve else None)
    push.connect(f"tcp://127.0.0.1:{port_out}")
    print("ready", flush=True)
    while True:
        frames = pull.recv_multipart(copy=False)
        if len(frames) == 1:
            break
        header, bufs = decode_data(frames, 1 << 30)
        t = tensor_from_frame(header.tensors[0], bufs[0])
        spec, buf = tensor_frame(t)
        push.send_multipart(data_message(header, [buf]), copy=False)
    if curve:
        auth.stop()
    ctx.destroy(linger=0)


def measure_hop_us(curve: bool, n: int = 2000) -> float:
    from agents.protocol import decode_data

    ctx = zmq.Context()
    keys = echo_keys = None
    auth = None
    if curve:
        keys, echo_keys = CurveKeys.generate(), CurveKeys.generate()
        gate = KeyGate()
        gate.allow(DATA_DOMAIN, [echo_keys.public])
        auth = start_authenticator(ctx, gate)
    pull = ctx.socket(zmq.PULL)
    curve_server(pull, keys, DATA_DOMAIN)
    port_back = pull.bind_to_random_port("tcp://127.0.0.1")
    probe = ctx.socket(zmq.PULL)
    port_in = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close()
    arg = f"{keys.public},{echo_keys.public},{echo_keys.secret}" if curve else ""
    child = subprocess.Popen([sys.executable, __file__, "--echo", str(port_in), str(port_back), arg or "-"],
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        push = ctx.socket(zmq.PUSH)
        curve_client(push, keys, echo_keys.public if curve else None)
        push.connect(f"tcp://127.0.0.1:{port_in}")
        x = torch.randn(1, 4096)
        rtts = []
        for i in range(n + 200):
            t0 = time.perf_counter()
            spec, buf = tensor_frame(x)
            header = DataHeader(run_id="bench", kind="hidden", phase="decode", step=i, micro_batch=0,
                                sender="bench", tensors=(spec,))
            push.send_multipart(data_message(header, [buf]), copy=False)
            frames = pull.recv_multipart(copy=False)
            h, bufs = decode_data(frames, 1 << 30)
            tensor_from_frame(h.tensors[0], bufs[0])
            if i >= 200:
                rtts.append(time.perf_counter() - t0)
        push.send(b"stop")
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)
    return statistics.median(rtts) / 2 * 1e6


# --------------------------------------------------------------------- HF baseline
def hf_decode_stamps(model, input_ids: torch.Tensor, new_tokens: int) -> list[float]:
    """Greedy decode with the model's own forward and a DynamicCache (what generate does, minus its bookkeeping)."""
    from transformers import DynamicCache

    stamps = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        # ``cache`` since transformers 5.24 (``past_key_values`` warns per call); the bench also runs older trees
        kw = {"cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values": cache}
        mask = torch.ones_like(input_ids)
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=True, **kw)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        stamps.append(time.perf_counter())
        for _ in range(new_tokens - 1):
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            out = model(input_ids=tok, attention_mask=mask, use_cache=True, **kw)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            stamps.append(time.perf_counter())
    return stamps


def rate(stamps: list[float]) -> float:
    """Tokens per second after the first (fencepost-free), as core.runs.metrics defines it."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


def step_compute_s(events, devices: list[str]) -> list[float]:
    """Per decode step: compute time summed over the stages (the work, without the hops)."""
    per: dict[int, float] = {}
    for e in events:
        if e.kind == "compute" and e.phase == "decode" and e.device in devices:
            per[e.step] = per.get(e.step, 0.0) + e.duration_s
    return list(per.values())


def hop_latencies_s(events, devices: list[str]) -> list[float]:
    """Send start on one stage to compute start of the same step on the next stage (the
    token hop back to the source feeds its next step): wire + framing + wake-up."""
    compute = {(e.device, e.step): e.start_s for e in events if e.kind == "compute"}
    out = []
    for e in events:
        if e.kind != "send" or e.phase != "decode":
            continue
        i = devices.index(e.device)
        nxt = devices[(i + 1) % len(devices)]
        step = e.step + 1 if nxt == devices[0] else e.step
        if (nxt, step) in compute:
            out.append(compute[(nxt, step)] - e.start_s)
    return out


def step_overhead_s(events, token_events, devices: list[str]) -> list[float]:
    """Per decode step: the time between two tokens at the source less the stages' compute
    of that step — every hop, framing and wake-up of the step. Offset-free: the gap is
    read on the source's clock and each compute span on its own agent's clock."""
    arrived = {t.step: t.t_s for t in token_events}
    compute: dict[int, float] = {}
    for e in events:
        if e.kind == "compute" and e.phase == "decode" and e.device in devices:
            compute[e.step] = compute.get(e.step, 0.0) + e.duration_s
    return [arrived[s] - arrived[s - 1] - c for s, c in compute.items() if s - 1 in arrived and s in arrived]


def hop_split_s(events, devices: list[str]) -> dict[str, list[float]]:
    """The parts of each decode hop that one agent's clock times (no clock estimate in them):
    ``pre_send`` (compute end to send start: framing the output), ``send_call`` (the send until
    it returned) on the sender, ``to_compute`` (receive returned to compute start: header
    decode, checks, tensor view) on the receiver. The rest of a hop (libzmq's IO threads,
    CurveZMQ, TCP, the wake-ups) is the hop less these."""
    compute = {(e.device, e.step): e for e in events if e.kind == "compute" and e.phase == "decode"}
    out: dict[str, list[float]] = {"pre_send": [], "send_call": [], "to_compute": []}
    for e in events:
        if e.phase != "decode" or e.device not in devices:
            continue
        c = compute.get((e.device, e.step))
        if e.kind == "send" and c is not None:
            out["pre_send"].append(e.start_s - c.end_s)
            out["send_call"].append(e.end_s - e.start_s)
        elif e.kind == "recv_wait" and c is not None and e.device != devices[0]:
            out["to_compute"].append(c.start_s - e.end_s)
    return out


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of a process, every thread, from the scheduler's exact accounting
    (/proc/PID/task/*/schedstat, in ns; /proc/PID/stat's tick sampling is too coarse for
    processes that run in 10-20 ms bursts)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            pass  # a thread that just ended
    return total / 1e9


def p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0]


# ---------------------------------------------------------------------- the bench
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per agent and for the HF baseline (1: the 2 cores are shared)")
    ap.add_argument("--three-by-three", action="store_true",
                    help="also bubbles vs no-bubbles with 3 stages x 3 micro-batches (a machine with >= 3 free cores)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from agents.protocol import SamplingSpec
    from core.models.checkpoints import make_benchmark_model
    from core.runs.coordinator import Coordinator, RunRequest
    from core.devices.local_cluster import LocalCluster
    from core.planning.plan import plan_from_boundaries
    from core.runs.metrics import decode_tokens_per_s

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        make_benchmark_model(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    units = layers + 2
    torch.set_num_threads(args.threads)

    plain, curve = [], []
    for _ in range(3):  # interleaved, so the machine's load drifts over both alike
        plain.append(measure_hop_us(curve=False, n=1000))
        curve.append(measure_hop_us(curve=True, n=1000))
    hop_plain, hop_curve = statistics.median(plain), statistics.median(curve)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(config["vocab_size"]), (4, PROMPT_TOKENS), generator=gen)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())

    solo = ["solo"]
    four = [f"four-{i}" for i in range(4)]
    two = ["two-0", "two-1"]
    q = units // 4
    plan1 = plan_from_boundaries("bench", units, solo, [])
    plan4 = plan_from_boundaries("bench", units, four, [q, 2 * q, 3 * q])
    plan2 = plan_from_boundaries("bench", units, two, [units // 2])
    three = [f"three-{i}" for i in range(3)] if args.three_by_three else []
    plan3 = plan_from_boundaries("bench", units, three, [units // 3, 2 * units // 3]) if three else None

    def request(n_seqs: int, mode: str, micro_batches: int) -> RunRequest:
        rows = tuple(tuple(r) for r in ids[:n_seqs].tolist())
        return RunRequest(input_ids=rows, attention_mask=tuple((1,) * PROMPT_TOKENS for _ in rows),
                          max_new_tokens=args.new_tokens, mode=mode, micro_batches=micro_batches,
                          eos_token_ids=(), sampling=SamplingSpec())

    figures: dict[str, list[float]] = {k: [] for k in ("hf", "agent1", "agent4", "bubbles", "nobubbles",
                                                       "bubbles3", "nobubbles3")}
    token_gaps: dict[str, list[float]] = {"hf": [], "agent1": [], "agent4": []}
    step_compute: dict[str, list[float]] = {"agent1": [], "agent4": []}
    hops: list[float] = []
    overhead: dict[str, list[float]] = {"agent1": [], "agent4": []}
    split: dict[str, list[float]] = {"pre_send": [], "send_call": [], "to_compute": []}
    per_stage: dict[str, list[float]] = {}
    cpu_s = {"hf": 0.0, "agent1": 0.0, "agent4": 0.0}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="edgeshard-bench-") as tmp:
        with LocalCluster(tmp, solo + four + two + three, threads_per_agent=args.threads) as cluster:
            with Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=60) as co:
                co.load(plan1, str(model_dir), threads=args.threads)
                co.load(plan4, str(model_dir), threads=args.threads)
                co.load(plan2, str(model_dir), threads=max(1, args.threads // 2))
                if plan3 is not None:
                    co.load(plan3, str(model_dir), threads=max(1, args.threads // 2))
                co.sync_clocks()
                for rnd in range(args.rounds + 1):  # the first round warms up
                    print(f"round {rnd}/{args.rounds}", file=sys.stderr, flush=True)
                    c0 = time.thread_time()  # 1 torch thread: HF computes on this thread
                    stamps = hf_decode_stamps(hf, ids[:1], args.new_tokens)
                    if rnd:
                        cpu_s["hf"] += time.thread_time() - c0
                        figures["hf"].append(rate(stamps))
                        token_gaps["hf"] += gaps(stamps)
                    for key, plan in (("agent1", plan1), ("agent4", plan4)):
                        pids = [cluster.pid_of(d) for d in plan.devices()]
                        c0 = sum(proc_cpu_s(p) for p in pids)
                        r = co.run(plan, request(1, "sequential", 1))
                        if rnd:
                            cpu_s[key] += sum(proc_cpu_s(p) for p in pids) - c0
                            overhead[key] += step_overhead_s(r.events, r.token_events, list(plan.devices()))
                            if key == "agent4":
                                for part, v in hop_split_s(r.events, list(plan.devices())).items():
                                    split[part] += v
                            for e in r.events:
                                if e.kind == "compute" and e.phase == "decode":
                                    per_stage.setdefault(e.device, []).append(e.duration_s)
                        stamps = [t.t_s for t in sorted(r.token_events, key=lambda t: t.step)][1:]
                        if rnd:
                            figures[key].append(decode_tokens_per_s(r.token_events))
                            token_gaps[key] += gaps(stamps)
                            devs = list(plan.devices())
                            step_compute[key] += step_compute_s(r.events, devs)
                            if len(devs) > 1:
                                hops.extend(hop_latencies_s(r.events, devs))
                    for key, mode in (("bubbles", "bubbles"), ("nobubbles", "no-bubbles")):
                        r = co.run(plan2, request(4, mode, 4))
                        if rnd:
                            figures[key].append(decode_tokens_per_s(r.token_events))
                        if plan3 is not None:
                            r = co.run(plan3, request(3, mode, 3))
                            if rnd:
                                figures[f"{key}3"].append(decode_tokens_per_s(r.token_events))
    med = {k: statistics.median(v) for k, v in figures.items() if v}
    best = {k: max(v) for k, v in figures.items() if v}
    quiet = {k: 1.0 / p10(v) for k, v in token_gaps.items()}
    med_gap = {k: statistics.median(v) for k, v in token_gaps.items()}
    out = {
        "bench": "runtime",
        "model": f"llama {layers} layers, hidden {config['hidden_size']}, {params / 1e6:.0f}M params, fp32",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch threads {args.threads}",
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "hf_decode_tok_s": round(med["hf"], 2),
        "agent1_decode_tok_s": round(med["agent1"], 2),
        "agent_vs_hf": round(med["agent1"] / med["hf"], 3),
        "agent_vs_hf_quiet": round(quiet["agent1"] / quiet["hf"], 3),
        "cpu_ms_per_token": {k: round(v / (args.rounds * args.new_tokens) * 1e3, 2) for k, v in cpu_s.items()},
        "agent_vs_hf_cpu": round(cpu_s["hf"] / cpu_s["agent1"], 3),
        "four_vs_one_cpu": round(cpu_s["agent1"] / cpu_s["agent4"], 3),
        "agent4_decode_tok_s": round(med["agent4"], 2),
        "four_vs_one": round(med["agent4"] / med["agent1"], 3),
        "four_vs_one_quiet": round(quiet["agent4"] / quiet["agent1"], 3),
        "per_token_ms_hf": round(med_gap["hf"] * 1e3, 2),
        "per_token_ms_1_stage": round(med_gap["agent1"] * 1e3, 2),
        "per_token_ms_4_stages": round(med_gap["agent4"] * 1e3, 2),
        "per_token_ms_p10": {k: round(1e3 / v, 2) for k, v in quiet.items()},
        "step_compute_ms_1_stage": round(statistics.median(step_compute["agent1"]) * 1e3, 2),
        "step_compute_ms_4_stages_sum": round(statistics.median(step_compute["agent4"]) * 1e3, 2),
        "runtime_hop_us_median": round(statistics.median(hops) * 1e6, 1),
        "step_overhead_ms_1_stage": round(statistics.median(overhead["agent1"]) * 1e3, 3),
        "step_overhead_ms_4_stages": round(statistics.median(overhead["agent4"]) * 1e3, 3),
        "runtime_hop_us_from_steps": round((statistics.median(overhead["agent4"])
                                            - statistics.median(overhead["agent1"])) / 4 * 1e6, 1),
        "hop_split_us_median": {k: round(statistics.median(v) * 1e6, 1) if v else None for k, v in split.items()},
        "step_compute_ms_per_stage": {d: round(statistics.median(v) * 1e3, 3) for d, v in per_stage.items()},
        "runtime_hop_us_p10": round(p10(hops) * 1e6, 1),
        "hop_us_plain": round(hop_plain, 1),
        "hop_us_curve": round(hop_curve, 1),
        "curve_cost_us": round(hop_curve - hop_plain, 1),
        "bubbles_tok_s_2x4": round(med["bubbles"], 2),
        "nobubbles_tok_s_2x4": round(med["nobubbles"], 2),
        "nobubbles_vs_bubbles": round(med["nobubbles"] / med["bubbles"], 3),
        "nobubbles_vs_bubbles_best_round": round(best["nobubbles"] / best["bubbles"], 3),
    }
    if plan3 is not None:
        out.update({"bubbles_tok_s_3x3": round(med["bubbles3"], 2), "nobubbles_tok_s_3x3": round(med["nobubbles3"], 2),
                    "nobubbles_vs_bubbles_3x3": round(med["nobubbles3"] / med["bubbles3"], 3),
                    "nobubbles_vs_bubbles_3x3_ideal": round(5 / 3, 3)})
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--echo":
        _echo(int(sys.argv[2]), int(sys.argv[3]), "" if sys.argv[4] == "-" else sys.argv[4])
    else:
        main()
