"""The paper's setup in miniature, measured: ``edgeshard experiment miniature``.

The other experiments are simulations on datasheet rooflines; this one runs the paper's four
methods for real. It builds the project's netns testbed shaped like the paper's §V-A, scaled
to a small generated Llama:

- device 1 is the source (an "Orin"), devices 2 … n-1 further edges, device n the "cloud";
- the edges run agents with an emulated compute slowdown and memory budget
  (agents/emulation.py, deployed over SSH with those flags); the cloud computes at this
  machine's speed with no budget;
- tc caps the source ↔ cloud link at a slow rate (the paper's 1 Mbit/s, scaled so one
  activation hop costs about what it costs the paper: ~0.9 × Edge-Solo's per-token time)
  and every other ordered pair at 50 Mbit/s × U(0.8, 1.2) (``random.Random(seed)``).

It then profiles the cluster (compute per unit on each agent, every link over the data
plane), plans Edge-Solo, Cloud-Edge-Even, Cloud-Edge-Opt and EdgeShard with the project's
strategies on that measured profile, loads and runs each plan on the agents (a
``sequential`` run of one sequence for latency, a ``no-bubbles`` run of the throughput
plan's m × K sequences for throughput), and puts each measured figure beside
``core.runs.simulator.simulate``'s prediction for the same plan. Both sides go through the
same ``core.runs.metrics`` functions. Every method's tokens must equal Edge-Solo's (one
model, greedy): a plan that computed something else would be reported, not hidden.

Needs root (network namespaces); without it ``TestbedError`` says so before any work.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import EdgeShardError
from core.reporting import NullReporter, Reporter

MINIATURE_METHODS = ("edge-solo", "cloud-edge-even", "cloud-edge-opt", "edgeshard")


@dataclass(frozen=True)
class MiniatureSetup:
    """The scaled-down testbed and workload (defaults: the shipped experiment)."""

    name: str = field(default_factory=lambda: f"m{os.getpid() % 0xFFFFF:x}z")
    """Testbed name (1-8 lowercase letters/digits); device i is ``<name><i>``. The default holds
    this process's id and ends in a non-hex letter, so concurrent testbeds never share names."""
    subnet: str = ""
    """"": a free 10.86.X.0/24."""
    edges: int = 3
    """Edge devices, the source included; one cloud device comes on top."""
    layers: int = 8
    hidden: int = 512
    vocab: int = 1024
    edge_slowdown: float = 3.0
    """Edges compute this many times slower than the cloud (the paper: AGX Orin vs RTX 3090)."""
    edge_memory_factor: float = 1.5
    """Each edge's emulated budget: this × the model's weights (Edge-Solo fits, as for 7B)."""
    slow_link_mbit: float = 0.5
    """Source ↔ cloud: at hidden 512 fp32 one token's activation (2 KiB) takes ~33 ms, about
    Edge-Solo's per-token time, as 16 KiB at 1 Mbit/s (131 ms) is for the paper's 7B (140 ms)."""
    edge_link_mbit: float = 50.0
    edge_link_spread: float = 0.2
    seed: int = 2024
    prompt_tokens: int = 16
    new_tokens: int = 24
    throughput_batch: int = 4
    """Sequences for the throughput plans (each method gets its best m × K within it)."""
    time_limit_s: float = 20.0
    rounds: int = 2
    """Runs per figure; the figure is the median of the runs' median step gaps."""
    profile_repeats: int = 5
    """Timed repeats of each unit's compute when profiling (the profile the plans and predictions use)."""
    link_first_probe_kib: int = 256
    """The first probe of each link; on the slow source ↔ cloud link it alone takes ~4 s (a
    reduced run, whose figures are not compared, sends less)."""

    def device_names(self) -> list[str]:
        return [f"{self.name}{i}" for i in range(1, self.edges + 2)]

    @property
    def source(self) -> str:
        return self.device_names()[0]

    @property
    def cloud(self) -> str:
        return self.device_names()[-1]


def link_caps(setup: MiniatureSetup):
    """The paper's network for the testbed's devices: slow source ↔ cloud, 50 Mbit/s ± spread elsewhere."""
    from core.devices.testbed import LinkCap, LinksFile

    rng = random.Random(setup.seed)
    caps = []
    names = setup.device_names()
    for a in names:
        for b in names:
            if a == b:
                continue
            bw = setup.edge_link_mbit * rng.uniform(1 - setup.edge_link_spread, 1 + setup.edge_link_spread)
            if {a, b} == {setup.source, setup.cloud}:
                bw = setup.slow_link_mbit
            caps.append(LinkCap(src=a, dst=b, bandwidth_mbit_s=round(bw, 3)))
    return LinksFile(links=tuple(caps))


@dataclass
class MethodMeasurement:
    method: str
    stages: str
    """``device[start:end) → …`` of the latency plan."""
    measured_ms: float | None = None
    predicted_ms: float | None = None
    throughput_stages: str = ""
    mk: str = ""
    measured_tps: float | None = None
    predicted_tps: float | None = None
    tokens_equal_edge_solo: bool = True
    status: str = "ok"


@dataclass
class MiniatureMeasurement:
    setup: MiniatureSetup
    rows: list[MethodMeasurement] = field(default_factory=list)
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Profiled (measured) rate (Mbit/s) and one-way latency (ms) of each link, ``src->dst``."""
    problem: object = None
    """The PlanningProblem of the measured profile (saved beside the table)."""
    load: tuple[float, float] = (0.0, 0.0)
    """Load average (1 min) when the runs started and ended."""

    def row(self, method: str) -> MethodMeasurement:
        return next(r for r in self.rows if r.method == method)


def _stages_text(plan) -> str:
    return " → ".join(f"{s.device}[{s.start}:{s.end})" for s in plan.stages)


def _request(ids: list[list[int]], n: int, setup: MiniatureSetup, mode: str, micro_batches: int):
    from agents.protocol import SamplingSpec
    from core.runs.coordinator import RunRequest

    rows = tuple(tuple(r) for r in ids[:n])
    return RunRequest(input_ids=rows, attention_mask=tuple((1,) * setup.prompt_tokens for _ in rows),
                      max_new_tokens=setup.new_tokens, mode=mode, micro_batches=micro_batches,
                      eos_token_ids=(), sampling=SamplingSpec())


def measure_miniature(setup: MiniatureSetup = MiniatureSetup(), reporter: Reporter | None = None,
                      workdir: str | Path | None = None) -> MiniatureMeasurement:
    """Build the testbed, deploy, profile, plan, run and predict; the testbed is always taken down."""
    from core.devices import testbed as tb

    rep = reporter or NullReporter()
    if os.geteuid() != 0:
        raise tb.TestbedError(
            "`edgeshard experiment miniature` builds a netns testbed and needs root (network namespaces, "
            "a bridge and tc): run it as root (sudo), or use the simulated experiments (table-iv, bandwidth, …)")
    with tempfile.TemporaryDirectory(prefix="edgeshard-miniature-", dir=workdir) as tmp:
        state_root = Path(tmp) / "state"
        rep.status(f"testbed {setup.name}: {setup.edges} edges + 1 cloud")
        subnet = setup.subnet or tb.free_subnet(os.getpid(), second_octet=86)
        state = tb.testbed_up(setup.edges + 1, links=link_caps(setup), name=setup.name, subnet=subnet,
                              state_root=state_root, advertise_mdns=False, reporter=rep)
        try:
            return _measure_on(state, setup, rep, Path(tmp))
        finally:
            rep.status("taking the testbed down")
            tb.testbed_down(setup.name, state_root=state_root)


def _deploy(state, setup: MiniatureSetup, weights_bytes: int, ws: Path, rep: Reporter) -> None:
    from core.devices.deploy import DeployOptions, SshTarget, deploy_many

    (ws / "known_hosts").write_text("\n".join(state.known_hosts_lines()) + "\n")
    budget_mib = setup.edge_memory_factor * weights_bytes / (1 << 20)
    groups = {
        "edges": ([d for d in state.devices if d.name != setup.cloud],
                  # the edges share this host's cores (netns): profiled cold, as before the flag existed
                  dict(memory_budget_mib=round(budget_mib, 1), compute_slowdown=setup.edge_slowdown,
                       shared_host=True)),
        "cloud": ([state.device(setup.cloud)], {}),
    }
    for label, (devs, emulation) in groups.items():
        rep.status(f"deploying agents over SSH to the {label} ({', '.join(d.name for d in devs)})")
        opts = DeployOptions(python=sys.executable, remote_dir=str(ws / "remote" / "{device}"), announce=False,
                             threads=1, **emulation)
        targets = [SshTarget(d.name, d.address, d.ssh_port, state.ssh_user) for d in devs]
        results = deploy_many(targets, key_file=state.operator_key, workspace=ws, options=opts, use_agent=False,
                              user_known=Path("/nonexistent"))
        failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
        if failed:
            raise EdgeShardError("deploying to the miniature testbed failed: "
                                 + "; ".join(f"{k}: {v}" for k, v in failed.items()))


def deploy_miniature(state, setup: MiniatureSetup, tmp: Path, rep: Reporter):
    """Make the miniature's model under ``tmp`` and deploy agents to the testbed ``state``:
    (model dir, its config, agent endpoints, coordinator keys)."""
    from core.devices.local_cluster import load_agents_file
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="llama", layers=setup.layers, hidden=setup.hidden, vocab=setup.vocab, seed=0)
    model_dir = make_model(recipe, tmp / "model")
    config = json.loads((model_dir / "config.json").read_text())
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    ws = tmp / "workspace"
    ws.mkdir()
    _deploy(state, setup, weights, ws, rep)
    endpoints, keys = load_agents_file(ws / "agents.json")
    return model_dir, config, endpoints, keys


def _measure_on(state, setup: MiniatureSetup, rep: Reporter, tmp: Path) -> MiniatureMeasurement:
    import msgspec
    import torch

    from core.devices.profiling import profile_cluster
    from core.planning.problem import PlanningProblem, Workload
    from core.planning.solvers.comparison import run_strategy
    from core.runs.coordinator import Coordinator
    from core.runs.metrics import median_step_gap_s
    from core.runs.simulator import simulate

    model_dir, config, endpoints, keys = deploy_miniature(state, setup, tmp, rep)
    out = MiniatureMeasurement(setup=setup)
    with Coordinator(endpoints, keys, heartbeat_timeout_s=60, request_timeout_s=180) as co:
        co.wait_ready(timeout_s=60)
        rep.status("profiling compute on every agent and every link")
        prof = profile_cluster(co, config, model_name="miniature-llama", prompt_tokens=setup.prompt_tokens,
                               batch_sizes=tuple(sorted({1, 2, setup.throughput_batch})), repeats=setup.profile_repeats,
                               threads=1, link_target_s=0.5, link_first_probe_bytes=setup.link_first_probe_kib << 10,
                               reporter=rep)
        out.links = {f"{l.src}->{l.dst}": (round(l.bandwidth_mbit_s, 3), round(l.latency_ms, 3))
                     for l in prof.profile.cluster.links}
        problem = PlanningProblem(name="miniature", profile=prof.profile, source=setup.source,
                                  workload=Workload(prompt_tokens=setup.prompt_tokens,
                                                    generated_tokens=setup.new_tokens,
                                                    batch_size=setup.throughput_batch))
        out.problem = problem
        latency_problem = msgspec.structs.replace(
            problem, workload=msgspec.structs.replace(problem.workload, batch_size=1))
        gen = torch.Generator().manual_seed(setup.seed)
        ids = torch.randint(3, setup.vocab, (setup.throughput_batch, setup.prompt_tokens), generator=gen).tolist()
        out.load = (os.getloadavg()[0], 0.0)
        reference = None
        for i, method in enumerate(MINIATURE_METHODS):
            rep.status(f"{method}: plan, load, run")
            rep.progress(i, len(MINIATURE_METHODS))
            lat = run_strategy(latency_problem, method, "latency", setup.time_limit_s)
            row = MethodMeasurement(method=method, stages=_stages_text(lat.plan) if lat.plan else "—")
            out.rows.append(row)
            if lat.status not in ("ok", "optimal"):
                row.status = f"no latency plan: {lat.status} {lat.error}".strip()
                continue
            co.load(lat.plan, str(model_dir), threads=1)
            co.run(lat.plan, _request(ids, 1, setup, "sequential", 1))  # warm-up
            gaps = []
            for _ in range(setup.rounds):
                r = co.run(lat.plan, _request(ids, 1, setup, "sequential", 1))
                gaps.append(median_step_gap_s(r.token_events))
                if reference is None and method == "edge-solo":
                    reference = r.tokens
                row.tokens_equal_edge_solo &= reference is None or r.tokens == reference
            row.measured_ms = statistics.median(gaps) * 1e3
            sim = simulate(latency_problem, lat.plan, "sequential")
            row.predicted_ms = median_step_gap_s(sim.tokens) * 1e3
            thr = run_strategy(problem, method, "throughput", setup.time_limit_s)
            if thr.status not in ("ok", "optimal"):
                row.status = f"no throughput plan: {thr.status} {thr.error}".strip()
                continue
            plan = thr.plan
            m, k = plan.micro_batch_size, plan.micro_batches
            row.throughput_stages, row.mk = _stages_text(plan), f"{m}×{k}"
            co.load(plan, str(model_dir), threads=1)
            mode = "no-bubbles" if len(plan.stages) > 1 or k > 1 else "sequential"
            gaps = []
            for _ in range(setup.rounds):
                r = co.run(plan, _request(ids, m * k, setup, mode, k))
                gaps.append(median_step_gap_s(r.token_events, second_half=True))
            row.measured_tps = m * k / statistics.median(gaps)
            sim = simulate(problem, plan, mode, micro_batches=k, micro_batch_size=m)
            row.predicted_tps = m * k / median_step_gap_s(sim.tokens, second_half=True)
        rep.progress(len(MINIATURE_METHODS), len(MINIATURE_METHODS))
        out.load = (out.load[0], os.getloadavg()[0])
    return out
