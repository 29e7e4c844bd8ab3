"""Profiling puts a device's GPU unit times into the profile (``Profile.accelerator_times``) and the
planner places stages by them. The CI machine has no GPU, so the agents are handed a backend that
computes on this CPU under a GPU's name (real torch modules, real agents and sockets): its clock runs
``speedup`` times slower than the wall clock, so the "GPU" is that much faster, and it reports
``memory_bytes`` of memory."""

from __future__ import annotations

import time

import pytest
import torch

from agents.accelerators import CudaBackend

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
HEADROOM = 1 << 20


class CpuUnderAGpuName(CudaBackend):
    """A GPU as an agent and its profiler see one, computing on the CPU (the test's stand-in: no GPU here)."""

    def __init__(self, memory_bytes: int, speedup: float) -> None:
        self.memory_bytes, self.speedup, self.synced = memory_bytes, speedup, 0

    def devices(self):
        return (("cuda:0", "CPU under a GPU's name", self.memory_bytes),)

    def place(self, name):
        return torch.device("cpu")

    def sync(self, name):
        self.synced += 1

    def memory(self, name):
        return self.memory_bytes, self.memory_bytes

    def clock(self):
        return time.perf_counter() / self.speedup


def test_units_timed_on_a_gpu_are_synchronised_read_by_its_clock_and_budgeted_by_its_memory():
    from agents.profiler import profile_units
    from agents.protocol import ComputeOptions

    gpu = CpuUnderAGpuName(memory_bytes=64 << 20, speedup=1000.0)
    opts = ComputeOptions(config=TINY, prompt_tokens=8, batch_sizes=(1,), repeats=3, warmup=1, headroom_bytes=HEADROOM,
                          threads=1, units=(1,))
    on_gpu = profile_units(msgspec_replace(opts, device="cuda:0"), accelerators=gpu)
    on_cpu = profile_units(opts, accelerators=gpu)
    assert gpu.synced > 0
    assert on_gpu.memory_budget_bytes == (64 << 20) - HEADROOM and on_gpu.memory_total_bytes == 64 << 20
    assert on_gpu.accelerator == "cuda:CPU under a GPU's name"
    assert on_gpu.cache_timing.startswith("warm")  # a GPU's caches are not modelled: timed warm
    assert 0 < on_gpu.units[0].decode_s[0] < on_cpu.units[0].decode_s[0] / 10  # its clock, not the wall clock's


def test_a_gpu_the_backend_does_not_have_is_refused_before_any_unit_is_built():
    from agents.profiler import profile_units
    from agents.protocol import ComputeOptions

    with pytest.raises(ValueError, match="cuda:1.*no CUDA device of that name"):
        profile_units(ComputeOptions(config=TINY, device="cuda:1"), accelerators=CpuUnderAGpuName(1 << 30, 1.0))


def msgspec_replace(struct, **fields):
    import msgspec

    return msgspec.structs.replace(struct, **fields)


@pytest.fixture(scope="module")
def profiled():
    """One profile of two in-process agents: ``roomy`` has a GPU 20x its CPU's speed with room for the
    model, ``small`` one as fast that holds less than the model's weights."""
    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core.devices.profiling import profile_cluster
    from core.runs.coordinator import AgentEndpoint, Coordinator

    keys = CurveKeys.generate()
    gpus = {"roomy": CpuUnderAGpuName(HEADROOM + (64 << 20), 20.0), "small": CpuUnderAGpuName(HEADROOM + (64 << 10), 20.0)}
    agents = [Agent(d, keys.public, accelerators=gpus[d]).start() for d in gpus]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys,
                         heartbeat_timeout_s=60.0) as co:  # in-process agents share the GIL with profiling
            return profile_cluster(co, TINY, model_name="tiny", prompt_tokens=8, batch_sizes=(1,), repeats=3,
                                   headroom_bytes=HEADROOM, threads=1, network=False).profile
    finally:
        for a in agents:
            a.close()


def test_a_device_whose_agent_reports_a_gpu_gets_its_gpu_unit_times_and_memory_in_the_profile(profiled):
    gpus = {a.device: a for a in profiled.accelerator_times}
    assert sorted(gpus) == ["roomy", "small"]
    assert gpus["roomy"].torch_device == "cuda:0" and gpus["roomy"].memory_bytes == 64 << 20
    assert gpus["small"].memory_bytes == 64 << 10
    for dev, gpu in gpus.items():
        cpu, fast = profiled.times_of(dev).decode_s, gpu.times.decode_s
        assert len(fast) == profiled.model.num_units and gpu.times.device == dev
        assert sum(u[0] for u in fast) < sum(u[0] for u in cpu) / 4  # timed by the GPU's clock


def _plan_alone(profile, device):
    from core.planning.problem import default_problem, with_changes
    from core.planning.solvers import solve_placed

    others = tuple(d for d in profile.cluster.device_ids() if d != device)
    return solve_placed(with_changes(default_problem(profile, source=device), excluded_devices=others)).plan


def test_the_planner_puts_a_stage_on_a_profiled_gpu_that_is_faster_and_holds_it(profiled):
    assert [s.torch_device for s in _plan_alone(profiled, "roomy").stages] == ["cuda:0"]


def test_the_planner_keeps_a_stage_on_the_cpu_when_the_profiled_gpu_memory_cannot_hold_it(profiled):
    assert profiled.model.param_bytes > 64 << 10
    assert [s.torch_device for s in _plan_alone(profiled, "small").stages] == ["cpu"]
