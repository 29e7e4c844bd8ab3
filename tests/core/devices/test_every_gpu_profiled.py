"""A device that reports several GPUs has each one profiled (``cuda:N``), its quantized blocks timed on
each GPU too (``AcceleratorTimes.precision_times``), and the planner places its stage on any of them.
The CI machine has no GPU: the agent is handed a backend that computes on this CPU under two GPUs'
names (real torch modules, a real agent and sockets), ``cuda:0`` too small for the model."""

from __future__ import annotations

import msgspec
import pytest
import torch

from agents.accelerators import CudaBackend

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
HEADROOM = 1 << 20
MEMORY = {"cuda:0": HEADROOM + (64 << 10), "cuda:1": HEADROOM + (64 << 20)}


class TwoGpusOnTheCpu(CudaBackend):
    """Two GPUs as an agent and its profiler see them, computing on the CPU 20x faster by their clock."""

    def devices(self):
        return tuple((name, f"CPU under {name}", memory) for name, memory in MEMORY.items())

    def place(self, name):
        return torch.device("cpu")

    def sync(self, name):
        pass

    def memory(self, name):
        return MEMORY[name], MEMORY[name]

    def clock(self):
        import time

        return time.perf_counter() / 20.0


@pytest.fixture(scope="module")
def profiled_and_ratios():
    from agents.agent import Agent
    from agents.transport import CurveKeys

    keys = CurveKeys.generate()
    agent = Agent("twin", keys.public, accelerators=TwoGpusOnTheCpu()).start()
    with pytest.MonkeyPatch.context() as patch:  # no cache to evict: the units are timed warm (seconds, not minutes)
        patch.setattr("agents.profiler.last_level_cache_bytes", lambda: 0)
        yield _profile(agent, keys)


@pytest.fixture(scope="module")
def gpu_ratios(profiled_and_ratios):
    return profiled_and_ratios[1]


@pytest.fixture(scope="module")
def profiled(profiled_and_ratios):
    return profiled_and_ratios[0]


def _profile(agent, keys):
    from core.devices.profiling import profile_cluster
    from core.runs.coordinator import AgentEndpoint, Coordinator

    from agents.protocol import ComputeOptions
    from core.devices.profiling import block_time_ratios
    from core.reporting import NullReporter

    try:
        with Coordinator([AgentEndpoint(agent.device, agent.control_address, agent.keys.public)], keys,
                         heartbeat_timeout_s=60.0) as co:
            profile = profile_cluster(co, TINY, model_name="tiny", prompt_tokens=8, batch_sizes=(1,), repeats=3,
                                      headroom_bytes=HEADROOM, threads=1, network=False).profile
            options = ComputeOptions(config=TINY, prompt_tokens=8, batch_sizes=(1,), repeats=3,
                                     headroom_bytes=HEADROOM, threads=1)
            on_gpu = block_time_ratios(co, "twin", options, ("int8", "int4"), NullReporter(), "cuda:1")
            return profile, on_gpu  # what profile_cluster(weight_times=...) stores per GPU (each profile ~15 s here)
    finally:
        agent.close()


def test_every_gpu_a_device_reports_is_profiled_with_its_own_memory(profiled):
    gpus = {a.torch_device: a for a in profiled.accelerator_times}
    assert sorted(gpus) == ["cuda:0", "cuda:1"] and {a.device for a in gpus.values()} == {"twin"}
    assert gpus["cuda:0"].memory_bytes == 64 << 10 and gpus["cuda:1"].memory_bytes == 64 << 20
    assert all(len(a.times.decode_s) == profiled.model.num_units for a in gpus.values())


def test_quantized_blocks_are_timed_on_a_gpu_at_int8_only(gpu_ratios):
    # a GPU stage refuses int4 (packed for the CPU's kernel): not timed there
    assert [(t.device, t.weights) for t in gpu_ratios] == [("twin", "int8")] and gpu_ratios[0].decode_time_ratio > 0


def test_each_gpus_block_ratios_go_into_its_own_entry_of_the_profile():
    from core.devices.profiling import build_profile
    from agents.protocol import ComputeProfile, UnitTimes
    from core.models.weight_quality import DevicePrecisionTimes

    int8 = [DevicePrecisionTimes(device="a", weights="int8", decode_time_ratio=0.5, prefill_time_ratio=0.7)]
    units = tuple(UnitTimes(unit=i, decode_s=(1e-3,), decode_spread=(0.0,), prefill_s=(2e-3,), prefill_spread=(0.0,),
                            param_bytes=1) for i in range(4))
    c = ComputeProfile(device="a", decode_batch_sizes=(1,), prefill_token_counts=(8,), units=units,
                       memory_budget_bytes=1, memory_total_bytes=1, memory_available_bytes=1, accelerator="",
                       threads=1, seconds=0.0)
    profile = build_profile(TINY, {"a": c}, [], dtype="fp32", model_name="t", prompt_tokens=8,
                            on_gpu={("a", "cuda:0"): c, ("a", "cuda:1"): c}, gpu_precision_times={("a", "cuda:1"): int8})
    assert [(g.torch_device, g.precision_times) for g in profile.accelerator_times] == [("cuda:0", ()),
                                                                                         ("cuda:1", tuple(int8))]


def test_the_planner_puts_the_stage_on_the_gpu_that_holds_it_not_the_first(profiled):
    from core.planning.problem import default_problem
    from core.planning.solvers import solve_placed

    assert profiled.model.param_bytes > 64 << 10
    plan = solve_placed(default_problem(profiled, source="twin")).plan
    assert [s.torch_device for s in plan.stages] == ["cuda:1"]


def test_a_gpu_stages_int8_blocks_are_costed_by_that_gpus_ratio_not_its_cpus(profiled):
    from core.models.weight_quality import DevicePrecisionTimes
    from core.planning.cost import evaluate
    from core.planning.plan import plan_from_boundaries
    from core.planning.problem import default_problem

    def ratio(r):
        return (DevicePrecisionTimes(device="twin", weights="int8", decode_time_ratio=r, prefill_time_ratio=r),)

    gpus = tuple(msgspec.structs.replace(a, precision_times=ratio(0.5)) for a in profiled.accelerator_times)
    profile = msgspec.structs.replace(profiled, precision_times=ratio(3.0), accelerator_times=gpus)
    problem = default_problem(profile, source="twin")
    plan = plan_from_boundaries("tiny", profile.model.num_units, ["twin"], [])

    def decode_s(weights, torch_device):
        stages = (msgspec.structs.replace(plan.stages[0], weights=weights, torch_device=torch_device),)
        return evaluate(problem, msgspec.structs.replace(plan, stages=stages)).latency_per_token_s

    assert decode_s("int8", "cuda:1") < decode_s("fp", "cuda:1")  # the GPU's 0.5x
    assert decode_s("int8", "cpu") > decode_s("fp", "cpu")  # the CPU's 3x
