"""Issue 30's CLI edges (and issue 25's invalid-plan entrances) re-run as a new user would: every command
from a fresh HOME with ``python3 -m core.cli``, a markdown table of command, exit status, one-line answer,
wall time and the 1-minute load (for the closing note).

    python scripts/cli_edges.py /tmp/edges            # files, a cluster with a SIGKILLed agent, a live one
    python scripts/cli_edges.py /tmp/edges dead moe   # only the edges whose name holds one of these
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_files(F: Path) -> None:
    """A tiny Llama and plans (good and invalid), its problem and profile, a spatial problem and plan, a tiny
    Llava with pools and a workload, a tiny Mixtral with plans of -3 and 0 slots, EPD costs and a workload."""
    from msgspec import structs

    from core import formats
    from core.models.checkpoints import ModelRecipe, make_model
    from core.models.units import load_model_spec
    from core.planning.plan import plan_from_boundaries
    from core.planning.scenarios import DeviceSpec, synthetic_problem
    from core.techniques.phase_disaggregation.types import PoolConfig, Request, Workload
    from tests.techniques.spatial.conftest import make_problem

    F.mkdir(parents=True, exist_ok=True)
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                       F / "tiny-llama")
    devs = ["local-0", "local-1"]
    formats.save(F / "plan.json", plan_from_boundaries("tiny-llama", 6, devs, [3]))
    problem = synthetic_problem([DeviceSpec(id=x, tflops=1, memory_bandwidth_gb_s=10, memory_gib=8) for x in devs],
                                load_model_spec(model, "fp32", "tiny-llama"))
    formats.save(F / "problem.json", problem)
    formats.save(F / "profile.json", problem.profile)
    good = json.loads((F / "plan.json").read_text())
    for name, stages in {"overlap": [(0, 4), (3, 6)], "gap": [(0, 3), (4, 6)], "emptystage": [(0, 0), (0, 6)],
                         "nostages": []}.items():
        (F / f"plan-{name}.json").write_text(json.dumps({**good, "stages": [
            {**good["stages"][min(i, 1)], "device": devs[min(i, 1)], "start": a, "end": b}
            for i, (a, b) in enumerate(stages)]}))
    spatial = make_problem((4.0, 2.0))
    formats.save(F / "spatial.json", structs.replace(spatial, gateway="local-0", devices=tuple(
        structs.replace(x, id=f"local-{i}") for i, x in enumerate(spatial.devices))))
    formats.save(F / "pools.json", PoolConfig(encode=("local-0",), prefill=("local-1",), decode=("local-2",),
                                              decode_batch=1))
    formats.save(F / "workload.json", Workload(requests=tuple(
        Request(id=i, arrival_s=0.05 * i, images=1, tiles_per_image=2, prompt_tokens=5, output_tokens=4)
        for i in range(3))))
    make_model(ModelRecipe(family="mixtral", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5, experts=4),
               F / "tiny-mixtral")
    for name, slots in (("neg", -3), ("zero", 0)):
        (F / f"moe-plan-{name}.json").write_text(json.dumps({"format": "edgeshard.expert-offload-plan", "version": 1,
                                                            "device": "local-0", "slots": slots, "policy": "lru"}))
    for argv in (["epd", "make-model", "--out", F / "llava"], ["epd", "costs", "--out", F / "costs.json"],
                 ["epd", "workload", "--rate", "2", "--requests", "8", "--seed", "1", "--out", F / "small-workload.json"],
                 ["spatial", "plan", F / "spatial.json", "--strategy", "even", "--out", F / "spatial-plan.json"]):
        subprocess.run([sys.executable, "-m", "core.cli", *map(str, argv)], check=True, capture_output=True)


def main() -> None:
    from core.devices.local_cluster import LocalCluster

    F = Path(sys.argv[1])
    only = sys.argv[2:]
    if not (F / "tiny-llama").exists():
        make_files(F)
    home = Path(tempfile.mkdtemp(prefix="fresh-home-"))
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("EDGESHARD_WORKSPACE", None)
    rows = []

    def load1():
        return os.getloadavg()[0]

    def cli(name, *argv, show=None):
        if only and not any(o in name for o in only):
            return None
        la = load1()
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "core.cli", *map(str, argv)], env=env, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - t
        text = (show(p) if show else None) or (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or [""])[-1 if p.returncode == 0 else 0]
        rows.append((name, " ".join(map(str, argv)).replace(str(F), "F").replace(str(home), "~"), p.returncode, text[:260], wall, la))
        print(f"{name}: rc={p.returncode} {wall:.1f}s load {la:.1f} :: {text[:200]}", flush=True)
        return p

    M, PLAN = F / "tiny-llama", F / "plan.json"
    # ---- issue 25: invalid plans at the entrance (no agent started)
    for k in ("overlap", "gap", "emptystage", "nostages"):
        cli(f"invalid plan ({k})", "run", "--local", "--model", M, "--plan", F / f"plan-{k}.json", "--prompt", "x", "--no-record")
    cli("--micro-batches 2, one prompt", "run", "--local", "--model", M, "--plan", PLAN, "--prompt", "x", "--micro-batches", "2", "--no-record")

    # ---- dead agent (SIGKILLed, still listed)
    if not only or any(o.startswith("dead") for o in only):
        with LocalCluster(F / "dead-cluster", ["local-0", "local-1", "local-2"]) as lc:
            os.kill(lc.pid_of("local-1"), signal.SIGKILL)
            while "local-1" not in dict(lc.exited()):
                time.sleep(0.05)
            A = lc.agents_file
            time.sleep(3)
            cli("dead: run", "run", "--agents", A, "--model", M, "--plan", PLAN, "--prompt", "x", "--no-record")
            cli("dead: run --on-failure replan", "run", "--agents", A, "--model", M, "--plan", PLAN, "--prompt", "x", "--no-record", "--on-failure", "replan", "--problem", F / "problem.json")
            cli("dead: spatial run", "spatial", "run", F / "spatial.json", "--agents", A, "--strategy", "even", "--images", "1", "--workspace", F / "ws-dead.sqlite")
            cli("dead: epd run", "epd", "run", "--agents", A, "--model", F / "llava", "--pools", F / "pools.json", "--workload", F / "workload.json", "--workspace", F / "ws-dead.sqlite")
            cli("dead: epd profile", "epd", "profile", "--agents", A, "--model", F / "llava", "--pools", F / "pools.json", "--out", F / "c-dead.json")
            cli("dead: profile", "profile", "--agents", A, "--model", M, "--out", F / "p-dead.json", "--repeats", "1", "--no-network")
            cli("dead: serve", "serve", "--agents", A, "--model", M, "--plan", PLAN, "--port", "0", "--no-record")
            # inside the cluster's block: after it every agent is stopped, and the first listed (the live
            # local-0) was rightly named not running (the "misnamed" dead agent of stop 34's note)
            cli("dead: attention-offload run", "attention-offload", "run", "--agents", A, "--model", M, "--compute", "local-0", "--memory", "local-1", "--prompt", "x", "--no-record")

    # ---- the other edges
    cli("moe configure slots -3", "moe", "configure", F / "moe-plan-neg.json", F / "tiny-mixtral")
    cli("moe configure slots 0", "moe", "configure", F / "moe-plan-zero.json", F / "tiny-mixtral")
    cli("replan --problem profile.json (live, --local)", "run", "--local", "--model", M, "--plan", PLAN, "--prompt", "the river", "--max-new-tokens", "4", "--no-record", "--on-failure", "replan", "--problem", F / "profile.json",
        show=lambda p: p.stdout.strip().splitlines()[-1] if p.returncode == 0 else None)
    cli("epd search (small workload)", "epd", "search", "--costs", F / "costs.json", "--workload", F / "small-workload.json", "--devices", "3", "--trials", "20", "--json",
        show=lambda p: (lambda o: json.dumps({k: o.get(k) for k in ("picked", "best", "layout", "goodput_rps") if k in o}) or p.stdout[:200])(json.loads(p.stdout)) if p.returncode == 0 else None)
    cli("epd search --layout epd", "epd", "search", "--costs", F / "costs.json", "--workload", F / "small-workload.json", "--devices", "3", "--trials", "20", "--layout", "epd", "--out", F / "searched-pools.json")
    with LocalCluster(F / "live-cluster", ["local-0", "local-1", "local-2"]) as lc:
        A = lc.agents_file
        cli("epd run --json (tokens)", "epd", "run", "--agents", A, "--model", F / "llava", "--pools", F / "pools.json", "--workload", F / "workload.json", "--workspace", F / "ws.sqlite", "--json", "--events", F / "epd-events.jsonl",
            show=lambda p: (lambda o: f"outputs {[(x['request'], x['tokens']) for x in o['outputs']]}, wire x{o['wire']['measured_over_predicted']}, {sum(1 for _ in open(F / 'epd-events.jsonl'))} event lines")(json.loads(p.stdout.splitlines()[-1])) if p.returncode == 0 else None)
        cli("spatial run --json (scores)", "spatial", "run", F / "spatial.json", "--agents", A, "--strategy", "even", "--images", "1", "--workspace", F / "ws.sqlite", "--json",
            show=lambda p: (lambda o: f"class {o['images'][0]['class']}, {len(o['images'][0]['scores'])} scores, max err {o['max_abs_error']:.1e}, wire x{o['wire']['measured_over_predicted']}")(json.loads(p.stdout.splitlines()[-1])) if p.returncode == 0 else None)
        cli("run --plan SPATIAL --events", "run", "--plan", F / "spatial-plan.json", "--problem", F / "spatial.json", "--agents", A, "--images", "1", "--events", F / "sp-events.jsonl", "--no-record",
            show=lambda p: f"{p.stdout.strip().splitlines()[0][:150]}; {sum(1 for _ in open(F / 'sp-events.jsonl'))} event lines" if p.returncode == 0 else None)
        cli("attention-offload run --events --json", "attention-offload", "run", "--agents", A, "--model", M, "--compute", "local-0", "--memory", "local-1,local-2", "--prompt", "the river", "--max-new-tokens", "4", "--no-record", "--json", "--events", F / "ao-events.jsonl",
            show=lambda p: (lambda o: f"tokens {o['tokens']}, wire x{o['wire']['measured_over_predicted']}, {sum(1 for _ in open(F / 'ao-events.jsonl'))} event lines")(json.loads(p.stdout.splitlines()[-1])) if p.returncode == 0 else None)

    print("\n| edge | command | exit | answer | wall s | load (1 min) |\n|---|---|---|---|---|---|")
    for name, cmd, rc, text, wall, la in rows:
        print(f"| {name} | `{cmd}` | {rc} | {text.replace('|', '/')} | {wall:.1f} | {la:.1f} |")


if __name__ == "__main__":
    main()
