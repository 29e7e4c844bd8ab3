"""Where a runtime hop's wall time goes, from the kernel scheduler's own trace; one JSON line.

``bench/runtime.py`` measures a hop inside the runtime at ≈0.5 ms against ≈0.1 ms for the
same frames between two hot processes, and ``bench/investigations/hop_trace.py`` shows the hop's own CPU is
≈15 µs a side. This bench records the scheduler (``perf record -e sched:sched_waking -e
sched:sched_switch``, all CPUs, CLOCK_MONOTONIC) while a 4-stage sequential decode runs
on loopback agents, and follows each hop's chain of wake-ups thread by thread:

    sender worker ──wakes──▶ sender's libzmq IO thread ──(CurveZMQ, TCP)──wakes──▶
    receiver's libzmq IO thread ──wakes──▶ receiver worker (computes the next stage)

For each link of the chain it reports the *wake latency* (woken → on a core) and the
*run time* until it wakes the next thread, and for wake latencies whether the woken thread
waited for a core held by another thread (``waited_for_core``: some thread of ours or the
machine's ran on every CPU meanwhile) or for the CPU to wake up from idle (``from_idle``:
a CPU was idle, so the delay is the (virtual) CPU's own wake-up). Medians over every hop
of every decode step, in µs.

Needs root (perf tracepoints). Usage: python bench/investigations/hop_sched.py [--model DIR] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import torch  # noqa: E402

from agents.arguments import int_in  # noqa: E402
from agents.protocol import SamplingSpec  # noqa: E402
from core.devices.local_cluster import LocalCluster  # noqa: E402
from core.planning.plan import plan_from_boundaries  # noqa: E402
from core.runs.coordinator import Coordinator, RunRequest  # noqa: E402
from runtime_threads import busiest_threads, thread_cpu_s  # noqa: E402  (bench/runtime_threads.py)

EVENT = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<ts>\d+\.\d+):\s+sched:(?P<ev>sched_\w+):\s+(?P<rest>.*)$")
WAKING = re.compile(r"pid=(?P<pid>\d+)")
SWITCH = re.compile(r"prev_pid=(?P<prev>\d+).*?prev_state=(?P<state>\S+).*?next_pid=(?P<next>\d+)")


def parse(text: str):
    """perf script lines → (ts s, cpu, event, acting tid, target tid) tuples, time-ordered."""
    out = []
    for line in text.splitlines():
        m = EVENT.match(line)
        if not m:
            continue
        ts, cpu, ev, rest = float(m["ts"]), int(m["cpu"]), m["ev"], m["rest"]
        if ev == "sched_waking":
            w = WAKING.search(rest)
            if w:
                out.append((ts, cpu, "waking", int(m["tid"]), int(w["pid"])))
        elif ev == "sched_switch":
            s = SWITCH.search(rest)
            if s:
                out.append((ts, cpu, "switch", int(s["prev"]), int(s["next"])))
    out.sort()
    return out


def occupancy(events, n_cpus: int):
    """Per CPU, the (start, end, tid) runs from the switch events (tid 0: idle)."""
    runs: dict[int, list[tuple[float, float, int]]] = {c: [] for c in range(n_cpus)}
    current: dict[int, tuple[float, int]] = {}
    for ts, cpu, ev, _, target in events:
        if ev != "switch":
            continue
        if cpu in current:
            runs.setdefault(cpu, []).append((current[cpu][0], ts, current[cpu][1]))
        current[cpu] = (ts, target)
    return runs


def who_ran(runs, t0: float, t1: float, kind_of) -> dict[str, float]:
    """CPU seconds per kind of thread on every CPU in [t0, t1]."""
    out: dict[str, float] = {}
    for segments in runs.values():
        for a, b, tid in segments:
            if b <= t0 or a >= t1:
                continue
            k = kind_of(tid)
            out[k] = out.get(k, 0.0) + min(b, t1) - max(a, t0)
    return out


def first_switch_in(switch_in, after: float, tid: int) -> float | None:
    return next((ts for ts, t in switch_in if ts >= after and t == tid), None)


def hops(events, threads: dict[int, str], order: list[str]):
    """Every data hop stage i → i+1, walked back from the receiver worker's switch-in:
    (w1 sender worker wakes its IO thread, r1 it runs, w2 it wakes the receiver's IO thread,
    r2 that runs, w3 it wakes the receiver's worker, end: the worker runs)."""
    by_role = {r: t for t, r in threads.items()}
    wakings = [(ts, a, t) for ts, _, ev, a, t in events if ev == "waking"]
    switch_in = [(ts, t) for ts, _, ev, _, t in events if ev == "switch"]
    found = []
    for a, b in zip(order, order[1:]):
        s_worker, s_io, r_io, r_worker = (by_role.get(f"{a}.worker"), {t for t, r in threads.items() if r == f"{a}.io"},
                                          {t for t, r in threads.items() if r == f"{b}.io"}, by_role.get(f"{b}.worker"))
        for end, tid in switch_in:
            if tid != r_worker:
                continue
            w3 = max((w for w in wakings if w[0] <= end and w[2] == r_worker), default=None)
            if w3 is None or w3[1] not in r_io:
                continue
            r2 = max((s for s in switch_in if s[0] <= w3[0] and s[1] == w3[1]), default=None)
            w2 = r2 and max((w for w in wakings if w[0] <= r2[0] and w[2] == r2[1]), default=None)
            if not w2 or w2[1] not in s_io:
                continue
            r1 = max((s for s in switch_in if s[0] <= w2[0] and s[1] == w2[1]), default=None)
            w1 = r1 and max((w for w in wakings if w[0] <= r1[0] and w[2] == r1[1]), default=None)
            if not w1 or w1[1] != s_worker:
                continue
            firsts = all(first_switch_in(switch_in, w[0], w[2]) == r for w, r in ((w1, r1[0]), (w2, r2[0]), (w3, end)))
            if firsts:  # each thread's first time on a core after its wake-up (not a later slice)
                found.append({"w1": w1[0], "r1": r1[0], "w2": w2[0], "r2": r2[0], "w3": w3[0], "end": end})
    return found


def require_perf() -> None:
    """perf and the scheduler tracepoints, or a clear exit (root; tracefs mounted)."""
    if not Path("/sys/kernel/tracing/events/sched").is_dir():
        subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], capture_output=True)
    probe = subprocess.run(["perf", "list", "sched:sched_switch"], capture_output=True, text=True) \
        if shutil.which("perf") else None
    if probe is None or "sched:sched_switch" not in probe.stdout:
        raise SystemExit("hop_sched: needs perf with the sched tracepoints: run as root with tracefs mounted "
                         "(mount -t tracefs nodev /sys/kernel/tracing) and perf installed (apt install linux-perf)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "edgeshard" / "bench-llama-170m"))
    ap.add_argument("--new-tokens", type=int_in(2, 4096), default=24,
                    help="tokens to generate (>= 2: the hops traced are the decode steps')")
    args = ap.parse_args()
    require_perf()
    if not (Path(args.model) / "config.json").exists():
        from core.models.checkpoints import make_benchmark_model

        make_benchmark_model(args.model)
    units = json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"] + 2
    q = units // 4
    names = ["s0", "s1", "s2", "s3"]
    plan = plan_from_boundaries("bench", units, names, [q, 2 * q, 3 * q])
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).tolist()
    req = RunRequest(input_ids=tuple(map(tuple, ids)), attention_mask=((1,) * 16,), max_new_tokens=args.new_tokens,
                     mode="sequential", eos_token_ids=(), sampling=SamplingSpec())
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(tmp, names, threads_per_agent=1) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=60) as co:
        co.load(plan, args.model, threads=1)
        co.run(plan, req)  # warm-up; then the worker is the non-main thread with most CPU
        threads: dict[int, str] = {}
        kinds: dict[int, str] = {0: "idle"}
        for tid in os.listdir("/proc/self/task"):
            kinds[int(tid)] = "coordinator (bench process)"
        for d in names:
            pid = cluster.pid_of(d)
            for name in thread_cpu_s(pid):
                tid, comm = name.split(":", 1)
                kinds[int(tid)] = "agents' other threads"
                if comm.startswith("ZMQbg/IO"):
                    threads[int(tid)] = f"{d}.io"
            threads[int(busiest_threads(pid)[0])] = f"{d}.worker"
        data = Path(tmp) / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-q", "-a", "-k", "mono", "-e", "sched:sched_waking",
                                 "-e", "sched:sched_switch", "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        load = os.getloadavg()[0]
        co.run(plan, req)
        time.sleep(0.2)
        perf.send_signal(signal.SIGINT)
        if perf.wait(timeout=60) not in (0, -signal.SIGINT) or not data.is_file():
            raise SystemExit(f"hop_sched: perf record failed (exit {perf.returncode}); try it by hand: perf record -a -e sched:sched_switch")
        text = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,tid,cpu,time,event,trace"],
                              capture_output=True, text=True, check=True).stdout
    events = parse(text)
    n_cpus = os.cpu_count() or 1
    runs = occupancy(events, n_cpus)
    found = hops(events, threads, names)

    def kind_of(tid: int) -> str:
        return "the hop's own threads" if tid in threads else kinds.get(tid, "other processes")

    parts = {"sender_io_wake_wait": ("w1", "r1"), "sender_io_run_curve_tcp": ("r1", "w2"),
             "receiver_io_wake_wait": ("w2", "r2"), "receiver_io_run_curve_handoff": ("r2", "w3"),
             "receiver_worker_wake_wait": ("w3", "end")}
    figures = {k: [(h[b] - h[a]) * 1e6 for h in found] for k, (a, b) in parts.items()}
    # in the three waits: what the CPUs did meanwhile (µs of CPU, all CPUs, median per hop)
    during: dict[str, dict[str, list[float]]] = {}
    for k, (a, b) in parts.items():
        if "wait" not in k:
            continue
        for h in found:
            for kind, sec in who_ran(runs, h[a], h[b], kind_of).items():
                during.setdefault(k, {}).setdefault(kind, []).append(sec * 1e6)
    med = lambda v: round(statistics.median(v), 1) if v else None  # noqa: E731
    out = {"bench": "hop_sched", "unit": "µs per hop (median over hops)", "load_avg_1min": round(load, 2),
           "cpus": n_cpus, "hops_traced": len(found),
           "worker_wakes_io_to_next_worker_on_core": med([(h["end"] - h["w1"]) * 1e6 for h in found]),
           "parts": {k: med(v) for k, v in figures.items()},
           "cpu_use_during_waits_mean": {k: {kind: round(sum(v) / len(found), 1) for kind, v in sorted(d.items())}
                                         for k, d in during.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
