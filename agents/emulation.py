"""Emulated device limits: make one machine's agents behave like different edge devices.

Demos and teaching need a cluster whose devices differ, or every plan puts the whole
model on one of them. An agent started with a ``DeviceEmulation`` (``python -m agents
serve --memory-budget-mib M --compute-slowdown F``; ``edgeshard cluster local`` passes
them per agent) enforces both:

- **memory budget**: a shard whose weights exceed it is refused with ``ShardOverBudget``
  (error code ``over_budget``) and nothing stays loaded, as a device without the memory
  would fail; the profile reports the budget, so solvers plan within it;
- **compute slowdown**, one rule for every kind of work (``emulated``): a computation ends
  ``F`` × its CPU time after it began, or when it really ended if that is later — the agent
  sleeps the difference after it (``emulated_pause_s``; GIL released, so the control thread
  keeps answering). CPU time, not wall time: the agents of a local cluster share the host's
  cores, and time a computation spent waiting for a core another agent was using is not the
  device's computation (multiplied by ``F`` it made a device slower the busier its neighbours
  were). Used by every stage (``SlowedStage`` wraps its executor) and by every technique's own
  computations (its rooms call ``emulated`` / ``compute_began`` + ``end_emulated`` around each).
  Work that waits on other agents while it computes (an executor with ``slows_itself``) applies
  the rule to each compute segment between its waits, so the waits are not stretched. A wait
  inside one computation (a stage reading weights from throttled storage on its compute
  thread) is not multiplied either, but it overlaps the stretch: the step ends at
  F × its CPU time or when it really ended, not after F × CPU plus the read. The profile
  reports compute times × ``F`` (``scale_compute_profile``): a unit is profiled alone, where
  its wall time is its CPU time, and as cold as a run finds it (``shares_host``: the other
  agents computed on the same cores between two of its steps), so predictions and runs agree.

Links are shaped separately (``--link-mbit``, ``--link-latency-ms``). This module ships
with the agent: it must not import core/.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from agents.protocol import ComputeProfile

MIB = 1 << 20


def emulated_pause_s(slowdown: float, wall_s: float, cpu_s: float) -> float:
    """How long an emulated device ``slowdown`` times slower than this machine sleeps after a
    computation that took ``wall_s`` and ``cpu_s`` of this machine's CPU: it ends ``slowdown`` × its
    CPU time after it began, as that device would on its own core, or when it really ended if later.

    Sleeping ``(slowdown − 1) × wall_s`` (the old stage rule) also multiplied the time the computation
    waited for a core that other agents of the same host were using: measured on 4 agents sharing
    2 cores, a fused tile's column slices waited for a core 1.2–1.6× their CPU time, and that wait came
    back ×3 to ×8. ``cpu_s`` > ``wall_s`` (CPU counted on several threads): by the wall time."""
    if slowdown <= 1.0:
        return 0.0
    return max(0.0, slowdown * min(cpu_s, wall_s) - wall_s)


def compute_began() -> tuple[float, float]:
    """(wall, CPU) clocks now, on the computing thread: where ``end_emulated`` measures from."""
    return time.perf_counter(), time.thread_time()


def end_emulated(slowdown: float, began: tuple[float, float]) -> None:
    """End a computation that began at ``began`` (``compute_began()`` on this same thread) as on a
    device ``slowdown`` times slower: sleep ``emulated_pause_s`` of its wall and CPU time.

    The CPU time is the computing thread's (``time.thread_time``), also when torch runs several
    intra-op threads: its OpenMP pool runs each parallel region's first share on the calling thread,
    which then waits for the others asleep (agents set ``OMP_WAIT_POLICY=PASSIVE``), so that
    thread's CPU time is about what the computation takes on this machine's free cores — the
    profile's wall time. Measured (8 linear pairs of 768×3072, 16 tokens, 2 threads): 22.1 ms of
    the thread's CPU for 23.1 ms wall on free cores, 22.6 ms for 64 ms wall at load 3; the process's
    CPU time counts every thread (43–44 ms: ×2) and whatever else the agent's other threads do at
    the time. Spinning workers (an operator's ``OMP_WAIT_POLICY=ACTIVE``) make the calling thread
    spin at the barriers too: its CPU time then tends to the wall time, the old wall rule's."""
    if slowdown > 1.0:
        wall0, cpu0 = began
        time.sleep(emulated_pause_s(slowdown, time.perf_counter() - wall0, time.thread_time() - cpu0))


@contextlib.contextmanager
def emulated(slowdown: float) -> Iterator[None]:
    """The block is one computation of a device ``slowdown`` times slower (``end_emulated``): it
    ends ``slowdown`` × its CPU time after it began. A block that raises ends at once."""
    began = compute_began()
    yield
    end_emulated(slowdown, began)


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
    shared_host: bool = False
    """The agent's host also runs other agents of its cluster that compute between its steps (a
    local cluster, the netns testbed: ``--shared-host``). Not a limit: it only says how to profile."""

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
        kv = f" + {kv_bytes / MIB:.1f} MiB of reserved KV cache" if kv_bytes else ""
        self.check_need(device, weight_bytes + kv_bytes,
                        f"units [{units[0]}, {units[1]}) need {weight_bytes / MIB:.1f} MiB of weights{kv}",
                        "plan fewer units on it (auto-solve: a profile of this device knows its budget)")

    def check_need(self, device: str, need_bytes: int, need: str, advice: str) -> None:
        """Refuse ``need_bytes`` beyond the budget with ``ShardOverBudget``: '``need`` but device …
        has a … MiB memory budget: ``advice``' (``need`` says what takes the memory and how much)."""
        if self.memory_budget_bytes and need_bytes > self.memory_budget_bytes:
            raise ShardOverBudget(f"{need} but device {device} has a {self.memory_budget_bytes / MIB:.1f} MiB memory "
                                  f"budget: {advice}")

    def shard_check(self, device: str, units: tuple[int, int]):
        """``check_shard`` for one stage as ``(weight_bytes, kv_bytes=)``: what a stage executor calls
        with its header sizes before it takes any memory (``StageExecutor(budget=)``)."""
        return lambda weight_bytes, kv_bytes=0: self.check_shard(device, weight_bytes, units, kv_bytes=kv_bytes)

    def budget(self, real_budget_bytes: int) -> int:
        """The budget a profile reports: the emulated one, never more than the real one."""
        if not self.memory_budget_bytes:
            return real_budget_bytes
        return min(self.memory_budget_bytes, real_budget_bytes) if real_budget_bytes > 0 else self.memory_budget_bytes

    def profile_clock(self, torch_device: str = "cpu"):
        """What a unit profile is timed by (``agents.profiler.profile_units``'s ``clock``): on an emulated
        slower CPU, the timing thread's CPU time — what ``emulated`` multiplies at run time, so a
        profile taken while other agents or tenants of the host compute is not inflated by their load
        ×F when the runs are not; so too on a shared host (``shared_host``), where the device is one of
        several emulated on these cores (its own speed is its CPU time, not the wait for a core its
        neighbours hold, and the demo profiles its agents at once: ``core.devices.profiling.profile_together``);
        otherwise the wall clock (a device's own speed, whatever it waits for)."""
        cpu_timed = self.compute_slowdown > 1.0 or self.shared_host
        return time.thread_time if cpu_timed and torch_device == "cpu" else time.perf_counter

    def shares_host(self, torch_device: str = "cpu") -> bool:
        """Whether the profile times units as on a host whose caches other agents overwrite between
        a stage's steps (``agents.profiler.profile_units``'s ``shared_host``): an agent of a local
        cluster or of the netns testbed, whose stages compute in turn on the same cores. Measured on
        the demo's cluster (load 3): its head stage's decode took 0.50 ms of CPU per step in runs, its
        head 0.09–0.2 ms when profiled back to back, ~0.4 ms after the cache was overwritten.
        Only where the launcher said so (``shared_host``): an agent deployed alone on a real device
        with a memory budget keeps its caches between steps and is profiled warm."""
        return self.shared_host and torch_device == "cpu"

    def slowed(self, executor):
        """``executor`` itself without a slowdown, else a wrapper whose computations take longer."""
        return executor if self.compute_slowdown <= 1.0 else SlowedStage(executor, self.compute_slowdown)

    def scale_compute_profile(self, profile: ComputeProfile) -> ComputeProfile:
        """``profile`` with times × slowdown and the emulated budget: what ``emulated`` makes a run's
        computations last (an emulated device's units are timed by CPU time: ``profile_clock``)."""
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
    """A stage executor whose prefill/decode/decode_positions end ``factor`` × their CPU time after they began (``emulated``)."""

    def __init__(self, executor, factor: float) -> None:
        self._executor = executor
        self.factor = factor

    def __getattr__(self, name):  # everything but the two computations is the executor's own
        return getattr(self._executor, name)

    def prefill(self, group, x, attention_mask):
        with emulated(self.factor):
            return self._executor.prefill(group, x, attention_mask)

    def decode(self, group, x):
        with emulated(self.factor):
            return self._executor.decode(group, x)

    def decode_positions(self, group, x, keep):
        with emulated(self.factor):
            return self._executor.decode_positions(group, x, keep)
