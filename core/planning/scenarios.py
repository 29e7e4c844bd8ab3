"""Synthetic planning problems from device specs, and the EdgeShard paper's testbed.

A device is described by what its datasheet says (peak fp16 TFLOPS, memory bandwidth,
memory); per-unit times follow a roofline with documented efficiency factors:

- decode of ``b`` sequences (one new token each) is memory-bandwidth bound: every
  weight is read once per step, plus the KV cache of each sequence:
  ``t = max((param_bytes + b · ctx · kv_bytes_per_token) / (bandwidth · bw_eff),
  b · flops_per_token / (tflops · flops_eff)) + overhead``
- prefill of ``n`` prompt tokens is compute bound:
  ``t = max(n · flops_per_token / (tflops · flops_eff), param_bytes / (bandwidth · bw_eff)) + overhead``

``ctx`` is the average context during generation, prompt + generated / 2. The times are
sampled at a few batch sizes / token counts and stored in the problem, so a scenario
is an ordinary problem file afterwards (no formula is applied when planning).

A *scenario* file (format ``edgeshard.scenario``) is a named list of problems, e.g.
one per model on the same testbed; ``edgeshard compare`` accepts it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

import msgspec

from core.devices.cluster import Cluster, Device, Link
from core.formats import register_format
from core.models.units import ModelSpec, ModelUnit, shipped_model
from core.planning.problem import PlanningProblem, Workload
from core.devices.profile import DeviceTimes, Profile, ProfiledWorkload

SCENARIO_FORMAT = "edgeshard.scenario"
SCENARIO_VERSION = 1

GIB = 2**30


class DeviceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Datasheet figures of a device class; the source of a synthetic device's times."""

    id: str
    tflops: float
    """Peak dense fp16 tensor throughput, 1e12 FLOP/s."""
    memory_bandwidth_gb_s: float
    """Peak memory bandwidth, 1e9 bytes/s."""
    memory_gib: float
    """Memory the planner may fill, GiB."""
    name: str = ""
    flops_efficiency: float = 0.4
    """Fraction of peak FLOPs reached by prefill kernels."""
    bandwidth_efficiency: float = 0.7
    """Fraction of peak bandwidth reached by decode (weight streaming)."""
    overhead_s: float = 0.0
    """Fixed per-unit cost per step (kernel launches, framework)."""


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.scenario"] = SCENARIO_FORMAT
    version: int = SCENARIO_VERSION
    name: str
    description: str = ""
    devices: tuple[DeviceSpec, ...] = ()
    """The specs the times were derived from (documentation; planning reads the problems)."""
    problems: tuple[PlanningProblem, ...]


register_format(SCENARIO_FORMAT, Scenario, SCENARIO_VERSION)


def unit_decode_s(spec: DeviceSpec, unit: ModelUnit, batch: int, ctx: float) -> float:
    mem = (unit.param_bytes + batch * ctx * unit.kv_bytes_per_token) / (spec.memory_bandwidth_gb_s * 1e9 * spec.bandwidth_efficiency)
    comp = batch * unit.flops_per_token / (spec.tflops * 1e12 * spec.flops_efficiency)
    return max(mem, comp) + spec.overhead_s


def unit_prefill_s(spec: DeviceSpec, unit: ModelUnit, tokens: int) -> float:
    comp = tokens * unit.flops_per_token / (spec.tflops * 1e12 * spec.flops_efficiency)
    mem = unit.param_bytes / (spec.memory_bandwidth_gb_s * 1e9 * spec.bandwidth_efficiency)
    return max(comp, mem) + spec.overhead_s


def _powers_up_to(n: int) -> tuple[int, ...]:
    out, x = [], 1
    while x < n:
        out.append(x)
        x *= 2
    out.append(max(n, 1))
    return tuple(sorted(set(out)))


def device_times(spec: DeviceSpec, model: ModelSpec, workload: Workload) -> DeviceTimes:
    """Roofline times of every unit on a device, sampled at batch 1, 2, 4 .. batch_size."""
    ctx = workload.prompt_tokens + workload.generated_tokens / 2
    batches = _powers_up_to(workload.batch_size)
    counts = tuple(b * workload.prompt_tokens for b in batches)
    return DeviceTimes(
        device=spec.id,
        decode_batch_sizes=batches,
        decode_s=tuple(tuple(unit_decode_s(spec, u, b, ctx) for b in batches) for u in model.units),
        prefill_token_counts=counts,
        prefill_s=tuple(tuple(unit_prefill_s(spec, u, n) for n in counts) for u in model.units),
    )


def full_mesh(
    device_ids: Sequence[str], bandwidth_mbit_s: float = 100.0, latency_ms: float = 1.0,
    overrides: dict[tuple[str, str], tuple[float, float]] | None = None,
) -> tuple[Link, ...]:
    """Directed links between every pair; ``overrides[(a, b)] = (mbit_s, ms)``."""
    overrides = overrides or {}
    links = []
    for a in device_ids:
        for b in device_ids:
            if a != b:
                bw, lat = overrides.get((a, b), (bandwidth_mbit_s, latency_ms))
                links.append(Link(src=a, dst=b, bandwidth_mbit_s=bw, latency_ms=lat))
    return tuple(links)


def synthetic_problem(
    devices: Sequence[DeviceSpec],
    model: str | ModelSpec = "llama-2-7b",
    *,
    workload: Workload | None = None,
    source: str | None = None,
    links: Sequence[Link] | None = None,
    bandwidth_mbit_s: float = 100.0,
    latency_ms: float = 1.0,
    dtype: str = "fp16",
    memory_headroom: float = 0.0,
    excluded_devices: Sequence[str] = (),
    name: str = "",
) -> PlanningProblem:
    """A planning problem from device specs and a model (shipped name or ModelSpec).

    Links default to a full mesh at ``bandwidth_mbit_s`` / ``latency_ms``; the source
    defaults to the first device. Example::

        synthetic_problem([DeviceSpec(id="a", tflops=20, memory_bandwidth_gb_s=200, memory_gib=32),
                           DeviceSpec(id="b", tflops=10, memory_bandwidth_gb_s=100, memory_gib=16)],
                          "llama-2-13b", bandwidth_mbit_s=50)
    """
    spec = shipped_model(model, dtype) if isinstance(model, str) else model
    workload = workload or Workload(prompt_tokens=128, generated_tokens=128, batch_size=1)
    ids = [d.id for d in devices]
    if links is None:
        links = full_mesh(ids, bandwidth_mbit_s, latency_ms)
    cluster = Cluster(
        devices=tuple(Device(id=d.id, name=d.name or d.id, memory_bytes=int(d.memory_gib * GIB)) for d in devices),
        links=tuple(links),
    )
    profile = Profile(
        model=spec, cluster=cluster,
        times=tuple(device_times(d, spec, workload) for d in devices),
        profiled_workload=ProfiledWorkload(prompt_tokens=workload.prompt_tokens, batch_size=workload.batch_size),
        source="synthetic",
        notes="roofline times from device specs (core.planning.scenarios)",
    )
    return PlanningProblem(
        name=name or f"{spec.name} on {len(devices)} devices", profile=profile,
        source=source or ids[0], workload=workload, memory_headroom=memory_headroom,
        excluded_devices=tuple(excluded_devices),
    )


# --- the EdgeShard paper's testbed ---------------------------------------------------

AGX_ORIN = dict(tflops=27.0, memory_bandwidth_gb_s=204.8, memory_gib=32.0, name="Jetson AGX Orin 32GB")
ORIN_NX = dict(tflops=12.0, memory_bandwidth_gb_s=102.4, memory_gib=16.0, name="Jetson Orin NX 16GB")
RTX_3090 = dict(tflops=71.0, memory_bandwidth_gb_s=936.0, memory_gib=24.0, name="RTX 3090 server")

PAPER_EDGE_MBIT_S = 50.0
PAPER_EDGE_SPREAD = 0.2
PAPER_EDGE_LATENCY_MS = 1.0
PAPER_SERVER_MBIT_S = 1.0
PAPER_SERVER_LATENCY_MS = 20.0
PAPER_WORKLOAD = Workload(prompt_tokens=128, generated_tokens=128, batch_size=4)


def paper_devices(agx: int = 12, nx: int = 2, servers: int = 1) -> tuple[DeviceSpec, ...]:
    """12 AGX Orin-class, 2 Orin NX-class and 1 RTX 3090-class device (the paper's testbed)."""
    out = [DeviceSpec(id=f"agx-{i:02d}", **AGX_ORIN) for i in range(agx)]
    out += [DeviceSpec(id=f"nx-{i:02d}", **ORIN_NX) for i in range(nx)]
    out += [DeviceSpec(id=f"server-{i:02d}" if servers > 1 else "server", **RTX_3090) for i in range(servers)]
    return tuple(out)


def paper_links(
    devices: Sequence[DeviceSpec], seed: int = 2024, server_mbit_s: float = PAPER_SERVER_MBIT_S,
) -> tuple[Link, ...]:
    """50 Mbit/s ±20 % (uniform, per direction, seeded) between edges, ``server_mbit_s`` to/from servers."""
    rng = random.Random(seed)
    links = []
    for a in devices:
        for b in devices:
            if a.id == b.id:
                continue
            if a.id.startswith("server") or b.id.startswith("server"):
                links.append(Link(src=a.id, dst=b.id, bandwidth_mbit_s=server_mbit_s, latency_ms=PAPER_SERVER_LATENCY_MS))
            else:
                bw = PAPER_EDGE_MBIT_S * rng.uniform(1 - PAPER_EDGE_SPREAD, 1 + PAPER_EDGE_SPREAD)
                links.append(Link(src=a.id, dst=b.id, bandwidth_mbit_s=round(bw, 3), latency_ms=PAPER_EDGE_LATENCY_MS))
    return tuple(links)


def paper_problem(model: str = "llama-2-70b", workload: Workload = PAPER_WORKLOAD, devices: Sequence[DeviceSpec] | None = None,
                  server_mbit_s: float = PAPER_SERVER_MBIT_S, seed: int = 2024) -> PlanningProblem:
    """The paper's testbed serving one shipped model; the prompt is on ``agx-00``."""
    devices = tuple(devices or paper_devices())
    return synthetic_problem(
        devices, model, workload=workload, source=devices[0].id,
        links=paper_links(devices, seed, server_mbit_s), memory_headroom=0.1,
        name=f"{model} on the EdgeShard testbed ({len(devices)} devices, {server_mbit_s:g} Mbit/s to the server)",
    )


def paper_scenario() -> Scenario:
    """Llama-2-7B, 13B and 70B (fp16) on the paper's testbed (resources/scenarios/edgeshard-paper.json)."""
    devices = paper_devices()
    return Scenario(
        name="edgeshard-paper",
        description=(
            "The EdgeShard paper's testbed (12 Jetson AGX Orin-class, 2 Orin NX-class, 1 RTX 3090-class "
            "server; 50 Mbit/s ±20 % between edges, 1 Mbit/s and 20 ms to the server) serving Llama-2 "
            "7B/13B/70B in fp16 with 10 % memory headroom. Times are rooflines from the listed device "
            "specs (decode: weight bytes / (bandwidth × 0.7); prefill: FLOPs / (TFLOPS × 0.4)), not measurements."
        ),
        devices=devices,
        problems=tuple(paper_problem(m, devices=devices) for m in ("llama-2-7b", "llama-2-13b", "llama-2-70b")),
    )


# --- random small instances (tests, simulator) --------------------------------------

def random_problem(
    seed: int, devices: int = 4, units: int = 8, *, tightness: float = 1.3, batch: int = 1,
    kv: bool = True, workspace: bool = True, latency: bool = True,
) -> PlanningProblem:
    """A small random problem with unrelated times, tight memory and asymmetric links.

    ``tightness`` ≈ total budget / model bytes: near 1, nearly every device must be used.
    Deterministic for a seed.
    """
    rng = random.Random(seed)
    unit_list = []
    for u in range(units):
        kind = "embedding" if u == 0 else ("head" if u == units - 1 else "decoder_block")
        unit_list.append(ModelUnit(
            index=u, kind=kind, name=f"u{u}",
            param_bytes=rng.randint(50, 150) * 1_000_000,
            activation_bytes_per_token=4 if kind == "head" else rng.choice([4096, 8192, 16384]),
            kv_bytes_per_token=rng.randint(1, 8) * 1024 if (kv and kind == "decoder_block") else 0,
            workspace_bytes_per_token=rng.randint(0, 64) * 1024 if workspace else 0,
        ))
    model = ModelSpec(name=f"random-{seed}", family="llama", dtype="fp16", units=tuple(unit_list))
    wl = Workload(prompt_tokens=rng.choice([8, 16, 32]), generated_tokens=rng.choice([8, 32]), batch_size=batch)
    total = model.param_bytes
    ids = [f"d{i}" for i in range(devices)]
    shares = [rng.uniform(0.3, 1.0) for _ in ids]
    budget = total * tightness
    devs = tuple(Device(id=i, memory_bytes=int(budget * s / sum(shares))) for i, s in zip(ids, shares))
    links = []
    for a in ids:
        for b in ids:
            if a != b and rng.random() > 0.05:
                links.append(Link(src=a, dst=b, bandwidth_mbit_s=rng.choice([1, 5, 20, 100, 1000]) * rng.uniform(0.5, 1.5),
                                  latency_ms=rng.uniform(0, 5) if latency else 0.0))
    batches = _powers_up_to(batch)
    times = []
    for i in ids:
        speed = rng.uniform(0.2, 5.0)
        dec = []
        pre = []
        for u in unit_list:
            base = (0.5 + u.param_bytes / 1e8) * rng.uniform(0.5, 2.0) / speed * 1e-3
            dec.append(tuple(base * (1 + 0.3 * (b - 1)) for b in batches))
            pre.append(tuple(base * 4 * b * wl.prompt_tokens / 8 for b in batches))
        times.append(DeviceTimes(device=i, decode_batch_sizes=batches, decode_s=tuple(dec),
                                 prefill_token_counts=tuple(b * wl.prompt_tokens for b in batches), prefill_s=tuple(pre)))
    profile = Profile(model=model, cluster=Cluster(devices=devs, links=tuple(links)), times=tuple(times), source="synthetic")
    return PlanningProblem(name=f"random-{seed}", profile=profile, source=ids[0], workload=wl)


PAPER_SCENARIO_PATH = "resources/scenarios/edgeshard-paper.json"


if __name__ == "__main__":  # regenerate the shipped scenario: python -m core.planning.scenarios
    from core.formats import save

    save(PAPER_SCENARIO_PATH, paper_scenario())
    print(f"wrote {PAPER_SCENARIO_PATH}")
