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
#
# The paper (Zhang et al., "EdgeShard", 2024) §V-A and Table III, line by line:
# - devices: 12 Jetson AGX Orin (32 GB), 2 Jetson Orin NX (16 GB) and one cloud server
#   with an RTX 3090 (24 GB). Peak bandwidth/TFLOPS below are the datasheet figures.
# - network: 1 Mbit/s between the source device and the cloud server; 50 Mbit/s ±20 %
#   between every other pair (edge–edge and edge–cloud), so the server is reachable
#   through another Orin. The ±20 % is drawn per direction, uniform, from a fixed seed.
#   The paper gives no link latency; 1 ms (one LAN hop) is ours.
# - model and workload: Llama2-7B/13B/70B in full precision (fp32); 32 prompt tokens
#   (WikiText-2) and 96 generated tokens; latency at batch 1, throughput at the largest
#   batch the participating devices hold, capped at 8 (the batch of the paper's
#   EdgeShard throughput for 7B).
# - the source (the device holding the prompt) is an AGX Orin; Fig. 9 moves it to an NX.
# Ours, not the paper's: times are rooflines (module docstring); the Jetsons' bandwidth
# efficiency is calibrated once on the paper's one single-device figure (Edge-Solo
# Llama2-7B, 140.34 ms/token: 0.94 of the 204.8 GB/s peak), the server keeps the
# default 0.7; 10 % of every device's memory is kept free for the OS and runtime.

AGX_ORIN = dict(tflops=27.0, memory_bandwidth_gb_s=204.8, memory_gib=32.0, name="Jetson AGX Orin 32GB")
ORIN_NX = dict(tflops=12.0, memory_bandwidth_gb_s=102.4, memory_gib=16.0, name="Jetson Orin NX 16GB")
RTX_3090 = dict(tflops=71.0, memory_bandwidth_gb_s=936.0, memory_gib=24.0, name="RTX 3090 server")

JETSON_BANDWIDTH_EFFICIENCY = 0.94
"""Calibrated: Edge-Solo Llama2-7B fp32 on one AGX Orin = the paper's 140.34 ms/token."""

PAPER_EDGE_MBIT_S = 50.0
PAPER_EDGE_SPREAD = 0.2
PAPER_EDGE_LATENCY_MS = 1.0
PAPER_SERVER_MBIT_S = 1.0
PAPER_SERVER_LATENCY_MS = 20.0
"""The older testbed only: every edge reaches the server over a slow 20 ms link."""
PAPER_WORKLOAD = Workload(prompt_tokens=32, generated_tokens=96, batch_size=8)
PAPER_DTYPE = "fp32"
PAPER_SOURCE = "agx-00"
PAPER_SEED = 2024
PAPER_MODELS = ("llama-2-7b", "llama-2-13b", "llama-2-70b")

LEGACY_WORKLOAD = Workload(prompt_tokens=128, generated_tokens=128, batch_size=4)


def paper_devices(agx: int = 12, nx: int = 2, servers: int = 1, calibrated: bool = True) -> tuple[DeviceSpec, ...]:
    """12 AGX Orin, 2 Orin NX and 1 RTX 3090 server (the paper's testbed).

    ``calibrated``: Jetsons at the calibrated bandwidth efficiency (else the 0.7 default).
    """
    jetson = dict(bandwidth_efficiency=JETSON_BANDWIDTH_EFFICIENCY) if calibrated else {}
    out = [DeviceSpec(id=f"agx-{i:02d}", **AGX_ORIN, **jetson) for i in range(agx)]
    out += [DeviceSpec(id=f"nx-{i:02d}", **ORIN_NX, **jetson) for i in range(nx)]
    out += [DeviceSpec(id=f"server-{i:02d}" if servers > 1 else "server", **RTX_3090) for i in range(servers)]
    return tuple(out)


def _is_server(device_id: str) -> bool:
    return device_id.startswith("server")


def paper_links(
    devices: Sequence[DeviceSpec], seed: int = PAPER_SEED, server_mbit_s: float = PAPER_SERVER_MBIT_S,
    source: str | None = PAPER_SOURCE,
) -> tuple[Link, ...]:
    """The paper's network: ``server_mbit_s`` between ``source`` and the servers, 50 Mbit/s ±20 %
    (uniform per direction, seeded) between every other pair, 1 ms each.

    ``source=None`` gives the older testbed: every edge reaches the servers at ``server_mbit_s``
    and 20 ms (not the paper's setting; kept for ``legacy_paper_scenario``).
    """
    rng = random.Random(seed)
    links = []
    for a in devices:
        for b in devices:
            if a.id == b.id:
                continue
            bw = PAPER_EDGE_MBIT_S * rng.uniform(1 - PAPER_EDGE_SPREAD, 1 + PAPER_EDGE_SPREAD)
            if source is None and (_is_server(a.id) or _is_server(b.id)):
                links.append(Link(src=a.id, dst=b.id, bandwidth_mbit_s=server_mbit_s, latency_ms=PAPER_SERVER_LATENCY_MS))
            elif source is not None and {a.id, b.id} & {source} and (_is_server(a.id) or _is_server(b.id)):
                links.append(Link(src=a.id, dst=b.id, bandwidth_mbit_s=server_mbit_s, latency_ms=PAPER_EDGE_LATENCY_MS))
            else:
                links.append(Link(src=a.id, dst=b.id, bandwidth_mbit_s=round(bw, 3), latency_ms=PAPER_EDGE_LATENCY_MS))
    return tuple(links)


def paper_problem(model: str = "llama-2-70b", workload: Workload = PAPER_WORKLOAD, devices: Sequence[DeviceSpec] | None = None,
                  server_mbit_s: float = PAPER_SERVER_MBIT_S, seed: int = PAPER_SEED, source: str | None = None,
                  dtype: str = PAPER_DTYPE) -> PlanningProblem:
    """The paper's testbed serving one shipped model (fp32), the prompt on ``source`` (default: the first device)."""
    devices = tuple(devices or paper_devices())
    source = source or devices[0].id
    return synthetic_problem(
        devices, model, workload=workload, source=source, dtype=dtype,
        links=paper_links(devices, seed, server_mbit_s, source), memory_headroom=0.1,
        name=f"{model} on the EdgeShard testbed ({len(devices)} devices, source {source}, "
             f"{server_mbit_s:g} Mbit/s source–server)",
    )


def legacy_paper_problem(model: str = "llama-2-70b", workload: Workload = LEGACY_WORKLOAD,
                         devices: Sequence[DeviceSpec] | None = None, server_mbit_s: float = PAPER_SERVER_MBIT_S,
                         seed: int = PAPER_SEED) -> PlanningProblem:
    """The older testbed: fp16, every edge 1 Mbit/s and 20 ms from the server, 128/128 tokens, batch 4."""
    devices = tuple(devices or paper_devices(calibrated=False))
    return synthetic_problem(
        devices, model, workload=workload, source=devices[0].id, dtype="fp16",
        links=paper_links(devices, seed, server_mbit_s, source=None), memory_headroom=0.1,
        name=f"{model} on the EdgeShard testbed ({len(devices)} devices, {server_mbit_s:g} Mbit/s to the server)",
    )


def paper_scenario() -> Scenario:
    """Llama-2-7B, 13B and 70B (fp32) on the paper's testbed (resources/scenarios/edgeshard-paper.json)."""
    devices = paper_devices()
    return Scenario(
        name="edgeshard-paper",
        description=(
            "The EdgeShard paper's testbed and workload (§V-A, Table III): 12 Jetson AGX Orin 32GB, 2 Orin NX "
            "16GB, 1 RTX 3090 24GB server; 1 Mbit/s between the source (agx-00) and the server, 50 Mbit/s ±20 % "
            "(seeded) between every other pair, 1 ms per hop; Llama-2 7B/13B/70B in fp32, 32 prompt and 96 "
            "generated tokens, throughput batch up to 8; 10 % memory headroom. Times are rooflines from the "
            "listed specs (decode: bytes read / (bandwidth × efficiency), Jetson efficiency 0.94 calibrated on "
            "the paper's Edge-Solo 7B 140.34 ms; prefill: FLOPs / (TFLOPS × 0.4)), not measurements. "
            "The paper's latency is at batch 1 (edgeshard experiment table-iv evaluates it so); "
            "edgeshard compare on this file plans the batch of 8."
        ),
        devices=devices,
        problems=tuple(paper_problem(m, devices=devices) for m in PAPER_MODELS),
    )


def legacy_paper_scenario() -> Scenario:
    """The scenario shipped before: fp16, 1 Mbit/s from *every* edge to the server (not the paper's)."""
    devices = paper_devices(calibrated=False)
    return Scenario(
        name="edgeshard-testbed-fp16",
        description=(
            "The EdgeShard paper's devices (12 Jetson AGX Orin-class, 2 Orin NX-class, 1 RTX 3090-class server) "
            "with a harsher network than the paper's: 50 Mbit/s ±20 % between edges but 1 Mbit/s and 20 ms "
            "between the server and every edge, so the server is out of reach; Llama-2 7B/13B/70B in fp16, "
            "128/128 tokens, batch 4, 10 % memory headroom. Times are rooflines from the listed device specs "
            "(decode: weight bytes / (bandwidth × 0.7); prefill: FLOPs / (TFLOPS × 0.4)), not measurements."
        ),
        devices=devices,
        problems=tuple(legacy_paper_problem(m, devices=devices) for m in PAPER_MODELS),
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
LEGACY_SCENARIO_PATH = "resources/scenarios/edgeshard-testbed-fp16.json"


if __name__ == "__main__":  # regenerate the shipped scenarios: python -m core.planning.scenarios
    from core.formats import save

    save(PAPER_SCENARIO_PATH, paper_scenario())
    save(LEGACY_SCENARIO_PATH, legacy_paper_scenario())
    print(f"wrote {PAPER_SCENARIO_PATH} and {LEGACY_SCENARIO_PATH}")
