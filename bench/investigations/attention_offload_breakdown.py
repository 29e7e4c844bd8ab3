"""Where an attention-offload decode step's time goes on the local cluster, measured vs the cost model.

Agents as processes (LocalCluster: c0, c1 compute, m0, m1 memory, the bench model of
bench/attention_offload.py: llama 4 blocks, 256 wide, 8 q / 2 kv heads). Per round: a profiling run
(one replica, as many steps as the measured runs) calibrates the cost model (``calibration.calibrate``), then a measured
one-replica run (24 steps, batch 3) and a rotational run (2 replicas, 3 batches of 3, 24 steps)
are predicted by the technique's simulator and decomposed, predicted and measured alike, by
``calibration.components`` from their timelines (the simulator emits the events a run records):
per decode layer the dense slice, the boundary slice (head, sampling, the step's turn-around,
the next step's first segment), each frame's send on both sides, the transit out (send end ->
attention start) and back (answer sent -> next slice starts), the attention, the residual hand-over,
the layer cycle and the step period. Per agent process: CPU seconds and run-queue wait over the
run (/proc/PID/task/*/schedstat). One JSON line (ms, medians over the decode steps past warm-up).

Run: python bench/investigations/attention_offload_breakdown.py [ROUNDS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import msgspec  # noqa: E402
import transformers  # noqa: E402

from attention_offload import PROMPTS, _llama, _prompts, _request_of, worker_share  # noqa: E402
from runtime_threads import thread_stats  # noqa: E402
from agents.arguments import int_in  # noqa: E402
from core.devices.local_cluster import LocalCluster  # noqa: E402
from core.runs.coordinator import Coordinator  # noqa: E402
from core.techniques.attention_offload.calibration import background_for_share, calibrate, components  # noqa: E402
from core.techniques.attention_offload.problem import OffloadPlan  # noqa: E402
from core.techniques.attention_offload.run import checkpoint_model, run_offload, run_staggered  # noqa: E402
from core.techniques.attention_offload.simulator import decode_tokens_per_s, simulate  # noqa: E402

_ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ARGS.add_argument("rounds", nargs="?", type=int_in(1, 100), default=2, help="measured rounds (default 2)")
_OPTIONS = _ARGS.parse_args()
ROUNDS = _OPTIONS.rounds
DEVICES = ["c0", "c1", "m0", "m1"]
STEPS = 24
SHORT = 2
"""A run of SHORT steps measures the CPU a run costs beyond its decode steps."""


def _cpu(lc) -> dict[str, tuple[float, float]]:
    out = {}
    for d in DEVICES:
        stats = thread_stats(lc.pid_of(d)).values()
        out[d] = (sum(s[0] for s in stats), sum(s[1] for s in stats))
    return out


def _delta(before, after, seconds) -> dict:
    return {d: {"cpu_share": round((after[d][0] - before[d][0]) / seconds, 3),
                "runqueue_share": round((after[d][1] - before[d][1]) / seconds, 3)} for d in DEVICES}


def _ms(parts: dict) -> dict:
    """Seconds as ms; shares (busy, host share) and process counts as they are."""
    plain = ("compute_busy", "memory_busy", "host_share", "background", "memory_share")
    return {k: round(v, 3) if k in plain else round(v * 1e3, 3) for k, v in parts.items()}


HOST_CORES = os.cpu_count() or 1


def _threads(lc) -> dict:
    return {d: thread_stats(lc.pid_of(d)) for d in DEVICES}


def main() -> None:
    out: dict = {"bench": "attention_offload_breakdown", "host_cores": HOST_CORES,
                 "loadavg_start": open("/proc/loadavg").read().split()[:3], "rounds": []}
    t0 = time.perf_counter()
    profiles, measured_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = _llama(root, "breakdown-llama")
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        enc = tok(PROMPTS, padding=True, return_tensors="pt")
        enc9 = tok(_prompts(9), padding=True, return_tensors="pt")
        model = checkpoint_model(model_dir)
        B = len(PROMPTS)
        plans = {"one_replica": (OffloadPlan(compute=("c0",), memory=("m0", "m1"), batch=B, in_flight=1),
                                 enc["input_ids"].shape[1]),
                 "rotational_2x3": (OffloadPlan(compute=("c0", "c1"), memory=("m0", "m1"), batch=3, in_flight=3),
                                    enc9["input_ids"].shape[1])}

        def calibrated(events_list, share):
            return calibrate(model, events_list, compute=["c0", "c1"], memory=["m0", "m1"], batch=B,
                             prompt_tokens=enc["input_ids"].shape[1], generated_tokens=STEPS, host_cores=HOST_CORES,
                             host_share=share)

        def problem_of(cal, key):
            return msgspec.structs.replace(cal.problem, workload=msgspec.structs.replace(
                cal.problem.workload, prompt_tokens=plans[key][1]))

        def predict(cal, key, shared=True, background=None):
            kw = dict(host_cores=HOST_CORES, background=cal.figures["background"] if background is None
                      else background) if shared else {}
            return simulate(problem_of(cal, key), plans[key][0], "rotational", generated_tokens=STEPS, **kw)

        with LocalCluster(root / "cluster", DEVICES, threads_per_agent=1) as lc, \
                Coordinator(lc.endpoints, lc.keys) as co:
            co.wait_ready(timeout_s=60)
            co.sync_clocks()
            run_offload(co, model_dir, "c0", ["m0", "m1"], _request_of(enc, 4))  # warm-up
            run_staggered(co, model_dir, ["c0", "c1"], ["m0", "m1"], _request_of(enc9, 4, 3), schedule="rotational")
            runs = {"one_replica": lambda n=STEPS: run_offload(co, model_dir, "c0", ["m0", "m1"], _request_of(enc, n)),
                    "rotational_2x3": lambda n=STEPS: run_staggered(co, model_dir, ["c0", "c1"], ["m0", "m1"],
                                                                    _request_of(enc9, n, 3), schedule="rotational")}
            for _ in range(ROUNDS):
                runs["one_replica"](SHORT)  # as before the measured runs: the previous run's aftermath settles
                before = _threads(lc)
                profile = run_offload(co, model_dir, "c0", ["m0", "m1"], _request_of(enc, STEPS))
                share = worker_share(before["c0"], _threads(lc)["c0"])
                profiles.append((profile.events, share))
                cal = calibrated([profile.events], share)
                rnd = {"loadavg": open("/proc/loadavg").read().split()[0], "calibration": _ms(cal.figures)}
                for key, run in runs.items():
                    plan, prompt = plans[key]
                    before = _cpu(lc)
                    run(SHORT)  # what a run costs beyond its decode steps (load, holds, prefill): subtracted
                    setup = {d: _cpu(lc)[d][0] - before[d][0] for d in DEVICES}
                    before, threads, w0 = _cpu(lc), _threads(lc), time.perf_counter()
                    result = run()
                    after, threads_after = _cpu(lc), _threads(lc)
                    cpu = _delta(before, after, time.perf_counter() - w0)
                    measured_runs.append((key, result))
                    sim = predict(cal, key)
                    independent = predict(cal, key, shared=False)
                    # the host's load during this run: the background under which the simulator gives
                    # c0 the share of a core its worker thread really got
                    run_share = worker_share(threads["c0"], threads_after["c0"])
                    at_load = background_for_share(problem_of(cal, key), plan, run_share, device="c0",
                                                   host_cores=HOST_CORES, generated_tokens=STEPS, mode="rotational")
                    sim_at_load = predict(cal, key, background=at_load)
                    measured = decode_tokens_per_s(result.token_events)
                    decode_tokens = (STEPS - SHORT) * plan.batch * plan.in_flight
                    sim_tokens = (STEPS - 1) * plan.batch * plan.in_flight
                    used = [d for d in DEVICES if d in plan.compute or d in plan.memory]
                    rnd[key] = {
                        "measured_tok_s": round(measured, 1), "predicted_tok_s": round(sim.decode_tokens_per_s, 1),
                        "measured_over_predicted": round(measured / sim.decode_tokens_per_s, 3),
                        "measured_over_predicted_independent_devices": round(
                            measured / independent.decode_tokens_per_s, 3),
                        "background_during_run": round(at_load, 2),
                        "measured_over_predicted_at_run_load": round(measured / sim_at_load.decode_tokens_per_s, 3),
                        "components_measured_ms": _ms(components(result.events, list(plan.compute), ["m0", "m1"],
                                                                 model.layers)),
                        "components_predicted_ms": _ms(components(sim.events, list(plan.compute), ["m0", "m1"],
                                                                  model.layers)),
                        "cpu_ms_per_decode_token": {d: {
                            "measured": round((after[d][0] - before[d][0] - setup[d]) / decode_tokens * 1e3, 3),
                            "predicted_work": round(sim.work_s.get(d, 0.0) / sim_tokens * 1e3, 3)} for d in used},
                        "core_share_worker_thread": {d: {
                            "measured": round(worker_share(threads[d], threads_after[d]), 3),
                            "predicted": round(sim.core_share(d), 3),
                            "predicted_at_run_load": round(sim_at_load.core_share(d), 3)} for d in used},
                        "agents": cpu,
                    }
                out["rounds"].append(rnd)
    # one calibration over every profiling run of the bench (pooled): the prediction does not swing
    pooled = calibrated([e for e, _ in profiles], statistics.fmean(s for _, s in profiles))
    out["pooled_calibration"] = _ms(pooled.figures)
    ratios: dict[str, list[float]] = {k: [] for k in plans}
    for key, result in measured_runs:
        ratios[key].append(round(decode_tokens_per_s(result.token_events) / predict(pooled, key).decode_tokens_per_s, 3))
    out["pooled_measured_over_predicted"] = {k: {"rounds": v, "median": statistics.median(v)}
                                             for k, v in ratios.items()}
    for key in plans:
        rows = [r[key] for r in out["rounds"]]
        out.setdefault("median_measured_over_predicted", {})[key] = {
            name: statistics.median(r[name] for r in rows) for name in (
                "measured_over_predicted", "measured_over_predicted_at_run_load",
                "measured_over_predicted_independent_devices")}
    out["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
