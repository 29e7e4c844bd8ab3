"""Emulated device limits: make one machine's agents behave like different edge devices.

Demos and teaching need a cluster whose devices differ, or every plan puts the whole
model on one of them. An agent started with a ``DeviceEmulation`` (``python -m agents
serve --memory-budget-mib M --compute-slowdown F``; ``edgeshard cluster local`` passes
them per agent) enforces both:

- **memory budget**: a shard whose weights exceed it is refused with ``ShardOverBudget``
  (error code ``over_budget``) and nothing stays loaded, as a device without the memory
  would fail; the profile reports the budget, so solvers plan within it;
- **compute slowdown**: each stage computation takes ``F`` times as long (the agent
  sleeps ``(F - 1) × the real compute time`` after it, GIL released, so the control thread
  keeps answering), and the profile reports compute times multiplied by ``F`` — the
  same rule in both places, so predictions and runs agree. A stage that waits on other agents
  while it computes (attention offloading's dense stage) slows its own compute segments
  instead (``slows_itself``): its waits for the memory agents are not computation. A spatial
  strip (agents/spatial_run.py) sleeps by its CPU time instead (``emulated_pause_s``): on a host whose cores the emulated
  devices share, time spent waiting for a core is not multiplied by ``F``.

Links are shaped separately (``--link-mbit``, ``--link-latency-ms``). This module ships
with the agent: it must not import core/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from agents.protocol import ComputeProfile

MIB = 1 << 20


def emulated_pause_s(slowdown: float, wall_s: float, cpu_s: float) -> float:
    """How long an emulated device ``slowdown`` times slower than this machine sleeps after a
    computation that took ``wall_s`` and ``cpu_s`` of this machine's CPU: it ends ``slowdown`` × its
    CPU time after it began, as that device would on its own core, or when it really ended if later.

    Sleeping ``(slowdown − 1) × wall_s`` (the stage rule) also multiplies the time the computation
    waited for a core that other agents of the same host were using: measured on 4 agents sharing
    2 cores, a fused tile's strips waited for a core 1.2–1.6× their CPU time, and that wait came
    back ×3 to ×8. ``cpu_s`` ≥ ``wall_s`` (a computation on several threads): the stage rule."""
    if slowdown <= 1.0:
        return 0.0
    return max(0.0, slowdown * min(cpu_s, wall_s) - wall_s)


class ShardOverBudget(ValueError):
    """A shard's weights do not fit this device's (emulated) memory budget."""

    code = "over_budget"


@dataclass(frozen=True)
class DeviceEmulation:
    """Limits one agent emulates; the defaults emulate nothing."""

    memory_budget_bytes: int = 0
    """0 = no emulated budget (the device's real memory applies)."""
    compute_slowdown: float = 1.0
    """≥ 1: how many times slower than this machine the device computes."""

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < 0:
            raise ValueError("the memory budget must be >= 0 (0 = none)")
        if not self.compute_slowdown >= 1.0:
            raise ValueError("the compute slowdown must be >= 1 (1 = this machine's speed)")

    @property
    def active(self) -> bool:
        return self.memory_budget_bytes > 0 or self.compute_slowdown > 1.0

    def describe(self) -> str:
        parts = []
        if self.memory_budget_bytes:
            mib = self.memory_budget_bytes / MIB
            parts.append(f"{mib:.1f} MiB budget" if mib < 100 else f"{mib:.0f} MiB budget")  # 3.8, not 4
        if self.compute_slowdown > 1.0:
            parts.append(f"{self.compute_slowdown:g}× slower compute")
        return ", ".join(parts) or "no emulated limits"

    def check_shard(self, device: str, weight_bytes: int, units: tuple[int, int], kv_bytes: int = 0) -> None:
        """Refuse a shard beyond the budget (``ShardOverBudget`` says by how much): its weights
        plus the KV cache it reserved at load."""
        total = weight_bytes + kv_bytes
        if self.memory_budget_bytes and total > self.memory_budget_bytes:
            kv = f" + {kv_bytes / MIB:.1f} MiB of reserved KV cache" if kv_bytes else ""
            raise ShardOverBudget(
                f"units [{units[0]}, {units[1]}) need {weight_bytes / MIB:.1f} MiB of weights{kv} but device {device} "
                f"has a {self.memory_budget_bytes / MIB:.1f} MiB memory budget: plan fewer units on it "
                "(re-profile so the solver knows the budget)"
            )

    def budget(self, real_budget_bytes: int) -> int:
        """The budget a profile reports: the emulated one, never more than the real one."""
        if not self.memory_budget_bytes:
            return real_budget_bytes
        return min(self.memory_budget_bytes, real_budget_bytes) if real_budget_bytes > 0 else self.memory_budget_bytes

    def slowed(self, executor):
        """``executor`` itself without a slowdown, else a wrapper whose computations take longer."""
        return executor if self.compute_slowdown <= 1.0 else SlowedStage(executor, self.compute_slowdown)

    def scale_compute_profile(self, profile: ComputeProfile) -> ComputeProfile:
        """``profile`` with times × slowdown and the emulated budget (the rule stages run by)."""
        f = self.compute_slowdown
        units = tuple(
            msgspec.structs.replace(u, decode_s=tuple(t * f for t in u.decode_s),
                                    prefill_s=tuple(t * f for t in u.prefill_s), expert_decode_s=u.expert_decode_s * f)
            for u in profile.units
        )
        return msgspec.structs.replace(
            profile, units=units, stage_decode_overhead_s=profile.stage_decode_overhead_s * f,
            stage_prefill_overhead_s=profile.stage_prefill_overhead_s * f,
            memory_budget_bytes=self.budget(profile.memory_budget_bytes), emulation=self.describe())


class SlowedStage:
    """A stage executor whose prefill/decode take ``factor`` times their real time."""

    def __init__(self, executor, factor: float) -> None:
        self._executor = executor
        self.factor = factor

    def __getattr__(self, name):  # everything but the two computations is the executor's own
        return getattr(self._executor, name)

    def _slowed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        time.sleep((self.factor - 1.0) * (time.perf_counter() - t0))
        return out

    def prefill(self, group, x, attention_mask):
        return self._slowed(self._executor.prefill, group, x, attention_mask)

    def decode(self, group, x):
        return self._slowed(self._executor.decode, group, x)
