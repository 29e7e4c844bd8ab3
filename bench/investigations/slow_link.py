"""Cloud-Edge-Even over the miniature's slow link: the profile's link figures and the
simulator's per-hop terms beside the run's own timeline; prints one JSON line.

A 2-device netns testbed (source = an emulated edge, 3x slower; cloud) with the miniature's
0.5 Mbit/s source <-> cloud cap, the miniature's model, profiled as the miniature profiles it;
Cloud-Edge-Even's latency plan is run (sequential, one sequence) and predicted. Per decode
step: each stage's compute, and each hop (sender's compute end -> receiver's compute start,
coordinator clock). Also the latency probes' raw one-way samples, 5 ms apart (as before 2026-11-26)
and spaced as the profiler now spaces them (``latency_probe_gap_s``). Needs root.

Usage: nice -n -10 python bench/investigations/slow_link.py [--slow-link-mbit 0.5] [--rounds 2]
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


def main() -> None:
    import torch

    from core.devices import testbed as tb
    from core.devices.profiling import latency_probe_gap_s, measure_pair, profile_cluster
    from core.planning.cost import link_occupancy_s, next_device, stage_compute_s, stage_output_bytes
    from core.planning.problem import PlanningProblem, Workload
    from core.planning.solvers.comparison import run_strategy
    from core.runs.coordinator import Coordinator
    from core.runs.metrics import median_step_gap_s
    from core.reporting import NullReporter
    from core.runs.miniature import MiniatureSetup, _request, deploy_miniature, link_caps
    from core.runs.simulator import simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--slow-link-mbit", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    setup = MiniatureSetup(edges=1, slow_link_mbit=args.slow_link_mbit)
    started = time.perf_counter()
    out: dict = {"bench": "slow_link", "load": [os.getloadavg()[0]]}
    with tempfile.TemporaryDirectory(prefix="edgeshard-slowlink-") as t:
        tmp = Path(t)
        subnet = tb.free_subnet(os.getpid(), second_octet=86)
        state = tb.testbed_up(2, links=link_caps(setup), name=setup.name, subnet=subnet,
                              state_root=tmp / "state", advertise_mdns=False)
        try:
            model_dir, config, endpoints, keys = deploy_miniature(state, setup, tmp, NullReporter())
            with Coordinator(endpoints, keys, heartbeat_timeout_s=60, request_timeout_s=180) as co:
                co.wait_ready(timeout_s=60)
                prof = profile_cluster(co, config, model_name="miniature-llama", prompt_tokens=setup.prompt_tokens,
                                       batch_sizes=(1,), repeats=5, threads=1, link_target_s=0.5)
                out["links"] = {f"{m.src}->{m.dst}": {"mbit_s": round(m.bandwidth_mbit_s, 4),
                                                      "one_way_ms": round(m.one_way_ms, 2)} for m in prof.links}
                # raw latency-probe samples of one more probe each way (same clock: one host)
                st = co.status()
                from agents.protocol import PeerSpec
                peers = {d: PeerSpec(device=d, stage=0, data_address=s.data_address, public_key=s.public_key)
                         for d, s in st.items()}
                raw = {}
                for a, b in ((setup.source, setup.cloud), (setup.cloud, setup.source)):
                    bw = next(m.bandwidth_mbit_s for m in prof.links if (m.src, m.dst) == (a, b))
                    for gap in (0.005, latency_probe_gap_s(bw)):
                        res = measure_pair(co, peers[a], peers[b], 16 << 10, latency_gap_s=gap)
                        raw[f"{a}->{b} {gap * 1e3:.0f} ms apart"] = [round(x * 1e3, 2) for x in res.one_way_s]
                out["probe_one_way_ms"] = raw
                problem = PlanningProblem(name="slow-link", profile=prof.profile, source=setup.source,
                                          workload=Workload(prompt_tokens=setup.prompt_tokens,
                                                            generated_tokens=setup.new_tokens, batch_size=1))
                plan = run_strategy(problem, "cloud-edge-even", "latency", 20.0).plan
                links = prof.profile.cluster.link_index()
                pred = []
                for j, s in enumerate(plan.stages):
                    nxt = next_device(plan, j)
                    nbytes = stage_output_bytes(problem, s, 1)
                    pred.append({"stage": f"{s.device}[{s.start}:{s.end})",
                                 "compute_ms": round(stage_compute_s(problem.profile.times_of(s.device), s,
                                                                     "decode", 1) * 1e3, 2),
                                 "hop_to": nxt, "bytes": nbytes,
                                 "occupancy_ms": round(link_occupancy_s(problem, s.device, nxt, nbytes) * 1e3, 2),
                                 "latency_ms": round(links[(s.device, nxt)].latency_ms, 2)})
                out["predicted"] = pred
                sim = simulate(problem, plan, "sequential")
                out["predicted_gap_ms"] = round(median_step_gap_s(sim.tokens) * 1e3, 2)
                gen = torch.Generator().manual_seed(setup.seed)
                ids = torch.randint(3, setup.vocab, (1, setup.prompt_tokens), generator=gen).tolist()
                co.load(plan, str(model_dir), threads=1)
                co.run(plan, _request(ids, 1, setup, "sequential", 1))
                gaps, comp, hops, sends = [], {}, {}, {}
                for _ in range(args.rounds):
                    r = co.run(plan, _request(ids, 1, setup, "sequential", 1))
                    gaps.append(median_step_gap_s(r.token_events))
                    ev = [e for e in r.events if e.phase == "decode"]
                    cs = {(e.stage, e.step): e for e in ev if e.kind == "compute"}
                    for e in ev:
                        if e.kind == "compute":
                            comp.setdefault(e.stage, []).append(e.duration_s * 1e3)
                        elif e.kind == "send":
                            sends.setdefault(e.stage, []).append(e.duration_s * 1e3)
                    n = len(plan.stages)
                    for (j, step), e in cs.items():
                        # stage j's output reaches stage j+1 in the same step, the last's the source's next step
                        nxt = cs.get((j + 1, step)) if j + 1 < n else cs.get((0, step + 1))
                        if nxt is not None:
                            hops.setdefault(j, []).append((nxt.start_s - e.end_s) * 1e3)
                med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
                out["measured_gap_ms"] = med([g * 1e3 for g in gaps])
                out["measured"] = [{"stage": j, "compute_ms": med(comp.get(j, [0])),
                                    "send_event_ms": med(sends.get(j, [0])),
                                    "hop_ms": med(hops.get(j, [0])), "hops": len(hops.get(j, []))}
                                   for j in range(len(plan.stages))]
        finally:
            tb.testbed_down(setup.name, state_root=tmp / "state")
    out["load"].append(os.getloadavg()[0])
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
