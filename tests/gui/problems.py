"""Small, real planning problems built from the core types, for the GUI tests.

Three devices (a memory-poor source "phone", a "laptop", a fast "server") and a
10-unit model; every number is chosen so a boundary drag changes the prediction.
"""

from __future__ import annotations

from core.devices.cluster import Cluster, Device, Link
from core.models.units import ModelSpec, ModelUnit
from core.planning.problem import PlanningProblem, Workload
from core.devices.profile import DeviceTimes, Profile, ProfiledWorkload

MiB = 2**20


def make_model(blocks: int = 8) -> ModelSpec:
    units = [ModelUnit(index=0, kind="embedding", name="embed", param_bytes=40 * MiB, activation_bytes_per_token=4096)]
    for i in range(blocks):
        units.append(ModelUnit(index=i + 1, kind="decoder_block", name=f"block {i}", param_bytes=100 * MiB,
                               activation_bytes_per_token=4096, kv_bytes_per_token=8192,
                               workspace_bytes_per_token=16384, params=50_000_000))
    units.append(ModelUnit(index=blocks + 1, kind="head", name="head", param_bytes=40 * MiB, activation_bytes_per_token=4))
    return ModelSpec(name="tiny-llama", family="llama", dtype="fp16", units=tuple(units),
                     hidden_size=1024, num_layers=blocks, vocab_size=32000)


def make_problem(phone_memory: int = 1200 * MiB) -> PlanningProblem:
    model = make_model()
    n = model.num_units
    speeds = {"phone": 4.0, "laptop": 2.0, "server": 1.0}
    devices = (
        Device(id="phone", memory_bytes=phone_memory, arch="aarch64", cores=8),
        Device(id="laptop", memory_bytes=4096 * MiB, arch="x86_64", cores=8),
        Device(id="server", memory_bytes=16384 * MiB, arch="x86_64", cores=32, accelerator="cuda:RTX 3090"),
    )
    links = tuple(
        Link(src=a.id, dst=b.id, bandwidth_mbit_s=100.0 if "phone" in (a.id, b.id) else 1000.0, latency_ms=2.0)
        for a in devices for b in devices if a.id != b.id
    )
    times = tuple(
        DeviceTimes(
            device=d.id,
            decode_batch_sizes=(1, 4),
            decode_s=tuple((0.002 * speeds[d.id], 0.005 * speeds[d.id]) for _ in range(n)),
            prefill_token_counts=(32, 128),
            prefill_s=tuple((0.01 * speeds[d.id], 0.04 * speeds[d.id]) for _ in range(n)),
        )
        for d in devices
    )
    profile = Profile(model=model, cluster=Cluster(devices=devices, links=links), times=times,
                      profiled_workload=ProfiledWorkload(prompt_tokens=32), source="synthetic")
    return PlanningProblem(name="tiny", profile=profile, source="phone",
                           workload=Workload(prompt_tokens=32, generated_tokens=32))
