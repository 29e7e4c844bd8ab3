"""Small hand-built planning problems for the sessions/simulator tests.

Built directly from the domain types (no solver, no scenario builder) so the expected
timings can be worked out by hand: every unit on a device takes the same time.
"""

from __future__ import annotations

from core.devices.cluster import Cluster, Device, Link
from core.models.units import ModelSpec, ModelUnit
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.planning.problem import PlanningProblem, Workload
from core.devices.profile import DeviceTimes, Profile

HIDDEN_BYTES = 4096  # activation bytes per token (hidden 2048 at fp16)


def make_model(blocks: int = 6) -> ModelSpec:
    units = [ModelUnit(index=0, kind="embedding", name="embed", param_bytes=1000,
                       activation_bytes_per_token=HIDDEN_BYTES)]
    for b in range(blocks):
        units.append(ModelUnit(index=b + 1, kind="decoder_block", name=f"block {b}", param_bytes=1000,
                               activation_bytes_per_token=HIDDEN_BYTES, kv_bytes_per_token=64))
    units.append(ModelUnit(index=blocks + 1, kind="head", name="head", param_bytes=1000,
                           activation_bytes_per_token=4))
    return ModelSpec(name="tiny-test", family="llama", dtype="fp16", units=tuple(units))


def make_problem(
    unit_decode_s: dict[str, float],
    *,
    blocks: int = 6,
    bandwidth_mbit_s: float = 100.0,
    latency_ms: float = 2.0,
    prompt_tokens: int = 16,
    generated_tokens: int = 8,
    batch_size: int = 1,
    prefill_per_token_factor: float = 0.25,
) -> PlanningProblem:
    """Devices named by ``unit_decode_s`` (seconds per unit per decode step at batch 1).

    Decode time scales linearly with batch (one sample at batch 1); prefill of n tokens
    takes ``prefill_per_token_factor · n`` decode steps' worth. All links symmetric.
    """
    model = make_model(blocks)
    devs = tuple(Device(id=d, memory_bytes=10**9) for d in unit_decode_s)
    links = tuple(
        Link(src=a, dst=b, bandwidth_mbit_s=bandwidth_mbit_s, latency_ms=latency_ms)
        for a in unit_decode_s for b in unit_decode_s if a != b
    )
    times = tuple(
        DeviceTimes(
            device=d,
            decode_batch_sizes=(1,),
            decode_s=tuple((t,) for _ in model.units),
            prefill_token_counts=(1,),
            prefill_s=tuple((t * prefill_per_token_factor,) for _ in model.units),
        )
        for d, t in unit_decode_s.items()
    )
    profile = Profile(model=model, cluster=Cluster(devices=devs, links=links), times=times, source="synthetic")
    return PlanningProblem(
        name="test", profile=profile, source=next(iter(unit_decode_s)),
        workload=Workload(prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, batch_size=batch_size),
    )


def make_plan(problem: PlanningProblem, devices: list[str], boundaries: list[int], m: int = 1, k: int = 1) -> ShardPlan:
    return plan_from_boundaries(problem.profile.model.name, problem.profile.model.num_units, devices,
                                boundaries, micro_batch_size=m, micro_batches=k)
