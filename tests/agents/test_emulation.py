"""Emulated devices: an agent enforces its memory budget, computes slower by its factor, and
profiles as the device it emulates; ``edgeshard cluster local`` sets them per agent."""

from __future__ import annotations

import time
import types

import pytest
import torch

from agents.emulation import MIB, DeviceEmulation, ShardOverBudget, SlowedStage, emulated
from agents.profiler import profile_compute
from agents.protocol import AgentState, ComputeOptions, ComputeProfile, UnitTimes
from agents.shard import StageExecutor
from core.cli import main as cli_main
from core.devices.local_cluster import LocalCluster, emulations_from_flags, per_agent_values
from core.errors import FormatError, ShardOverBudget as CoreShardOverBudget
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import Coordinator


def test_a_shard_beyond_the_budget_is_refused_naming_the_device_and_both_sizes():
    emu = DeviceEmulation(memory_budget_bytes=2 * MIB)
    emu.check_shard("edge-b", 2 * MIB, (1, 3))  # exactly the budget fits
    with pytest.raises(ShardOverBudget, match=r"3\.0 MiB.*edge-b.*2\.0 MiB"):
        emu.check_shard("edge-b", 3 * MIB, (1, 3))


def test_bad_emulation_values_are_refused():
    with pytest.raises(ValueError, match="slowdown"):
        DeviceEmulation(compute_slowdown=0.5)
    with pytest.raises(ValueError, match="budget"):
        DeviceEmulation(memory_budget_bytes=-1)


def test_a_slowed_stage_gives_the_same_outputs_and_lasts_at_least_the_factor_times_its_cpu_time(tiny_llama_dir):
    plain = StageExecutor(tiny_llama_dir, 0, 6)
    inner = StageExecutor(tiny_llama_dir, 0, 6)
    inner_cpu = []
    real_prefill = inner.prefill

    def timed_prefill(*args):
        c0 = time.thread_time()
        out = real_prefill(*args)
        inner_cpu.append(time.thread_time() - c0)
        return out

    inner.prefill = timed_prefill
    slowed = SlowedStage(inner, 3.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        want = plain.prefill(0, ids, mask)
        t0 = time.perf_counter()
        got = slowed.prefill(0, ids, mask)
        took = time.perf_counter() - t0
    assert torch.equal(want, got)
    assert took >= 3.0 * inner_cpu[0]  # it sleeps until then
    assert slowed.is_last and slowed.memory_bytes() == plain.memory_bytes()  # the rest is the executor's own


def test_a_slowed_stage_that_waited_for_a_core_is_slowed_by_its_cpu_time_not_its_wall_time(compute_clock):
    """4 agents on 2 cores: a decode of 2 ms CPU that took 5 ms (3 ms waiting for a core) on a
    6x slower device ends 12 ms after it began; the wall rule slept (6 - 1) x 5 ms, the wait x 6 too."""

    class Executor:
        def decode(self, group, x):
            compute_clock.run(5e-3, 2e-3)
            return x + 1

    assert SlowedStage(Executor(), 6.0).decode(0, 41) == 42
    assert compute_clock.slept == [pytest.approx(7e-3)]


def test_an_emulated_computation_that_raises_ends_at_once(compute_clock):
    with pytest.raises(RuntimeError), emulated(8.0):
        compute_clock.run(4e-3, 4e-3)
        raise RuntimeError("bad input")
    assert compute_clock.slept == []


class _AgentLike:
    device = "edge-c"
    emulation = DeviceEmulation(memory_budget_bytes=3 * MIB, compute_slowdown=4.0)


def test_an_emulated_device_profiles_with_its_budget_and_slowdown(tiny_llama_dir):
    import json
    from pathlib import Path

    config = json.loads(Path(tiny_llama_dir, "config.json").read_text())
    result = profile_compute(_AgentLike(), ComputeOptions(config=config, prompt_tokens=4, batch_sizes=(1,), repeats=1,
                                                          warmup=0))
    assert result.memory_budget_bytes == 3 * MIB
    assert result.emulation == "3.0 MiB budget, 4× slower compute"
    unit = UnitTimes(unit=1, decode_s=(1.0,), decode_spread=(0.1,), prefill_s=(2.0,), prefill_spread=(0.2,),
                     param_bytes=8)
    raw = ComputeProfile(device="edge-c", decode_batch_sizes=(1,), prefill_token_counts=(4,), units=(unit,),
                         memory_budget_bytes=10 * MIB, memory_total_bytes=16 * MIB, memory_available_bytes=12 * MIB,
                         accelerator="", threads=1, seconds=0.5, stage_decode_overhead_s=0.5)
    scaled = _AgentLike.emulation.scale_compute_profile(raw)
    assert scaled.units[0].decode_s == (4.0,) and scaled.units[0].prefill_s == (8.0,)
    assert scaled.units[0].decode_spread == (0.1,)  # a relative spread does not scale
    assert scaled.stage_decode_overhead_s == 2.0 and scaled.memory_budget_bytes == 3 * MIB


def test_an_emulated_slower_cpu_is_profiled_by_cpu_time_as_its_runs_are_slowed():
    assert DeviceEmulation(compute_slowdown=3.0).profile_clock("cpu") is time.thread_time
    assert DeviceEmulation(memory_budget_bytes=MIB).profile_clock("cpu") is time.perf_counter  # its own speed
    assert DeviceEmulation(compute_slowdown=3.0).profile_clock("cuda:0") is time.perf_counter  # kernels: not CPU


def test_a_device_emulated_on_a_shared_host_is_profiled_by_cpu_time_so_neighbours_do_not_lengthen_it():
    assert DeviceEmulation(memory_budget_bytes=MIB, shared_host=True).profile_clock("cpu") is time.thread_time
    assert DeviceEmulation(memory_budget_bytes=MIB, shared_host=True).profile_clock("cuda:0") is time.perf_counter


def test_per_agent_flags_take_one_value_or_one_per_agent():
    assert per_agent_values("8", 3, "--memory-mib") == [8.0, 8.0, 8.0]
    assert per_agent_values("24,16,12", 3, "--memory-mib") == [24.0, 16.0, 12.0]
    with pytest.raises(FormatError, match="2 values for 3 agents"):
        per_agent_values("1,2", 3, "--memory-mib")
    with pytest.raises(FormatError, match="not a number"):
        per_agent_values("lots", 3, "--memory-mib")
    emu = emulations_from_flags(["a", "b"], "10,20", "1,2.5")
    assert emu["b"] == DeviceEmulation(memory_budget_bytes=20 * MIB, compute_slowdown=2.5)
    with pytest.raises(FormatError, match="--slowdown"):
        emulations_from_flags(["a"], None, "0.5")


def test_cluster_local_refuses_a_slowdown_below_one_with_a_clear_error(capsys):
    code = cli_main(["cluster", "local", "-n", "2", "--slowdown", "1,0.2"])
    err = capsys.readouterr().err
    assert code != 0 and "--slowdown" in err and "Traceback" not in err


def test_local_agents_enforce_their_budgets_and_a_plan_within_them_loads(tmp_path, tiny_llama_dir):
    """Real agent processes: the small device refuses the embedding stage (typed error naming it)."""
    devices = ["big", "small"]
    emulation = {"big": DeviceEmulation(), "small": DeviceEmulation(memory_budget_bytes=int(0.2 * MIB))}
    with LocalCluster(tmp_path, devices, emulation=emulation) as cluster:
        with Coordinator(cluster.endpoints, cluster.keys) as co:
            co.wait_ready(30)
            too_big = plan_from_boundaries("tiny", 6, ["small", "big"], [3])
            with pytest.raises(CoreShardOverBudget, match="small.*memory budget"):
                co.load(too_big, tiny_llama_dir, timeout_s=60)
            assert co.status()["small"].memory_bytes == 0  # nothing stays loaded
            deadline = time.monotonic() + 30  # "big" may still be loading its part of the refused plan
            while co.status()["big"].state is AgentState.LOADING and time.monotonic() < deadline:
                time.sleep(0.05)
            fits = plan_from_boundaries("tiny", 6, ["big", "small"], [5])  # only the final norm + head on it
            co.load(fits, tiny_llama_dir, timeout_s=60)
            st = co.status()
            assert st["small"].state is AgentState.READY and 0 < st["small"].memory_bytes <= 0.2 * MIB


def test_an_emulated_pause_multiplies_the_cpu_time_not_the_wait_for_a_core():
    """6x slower, a strip that took 5 ms of which 2 ms on the CPU (3 ms waiting for a core other
    agents of the host used) ends 6 x 2 ms after it began: it sleeps 7 ms, not (6 - 1) x 5 ms."""
    from agents.emulation import emulated_pause_s

    assert emulated_pause_s(6.0, 5e-3, 2e-3) == pytest.approx(7e-3)
    assert emulated_pause_s(6.0, 5e-3, 5e-3) == pytest.approx(25e-3)  # no wait for a core: (6 - 1) x 5 ms
    assert emulated_pause_s(3.0, 4e-3, 9e-3) == pytest.approx(8e-3)  # CPU beyond the wall time: by the wall time
    assert emulated_pause_s(2.0, 5e-3, 2e-3) == 0.0  # waited longer than the device would take
    assert emulated_pause_s(1.0, 5e-3, 2e-3) == 0.0


def test_a_spatial_strip_on_several_torch_threads_is_slowed_by_its_threads_cpu_time(compute_clock, monkeypatch):
    """The computing thread's CPU time, whatever torch's thread count (``end_emulated``: the calling
    thread runs its share of each parallel region and sleeps at the barrier); before, a strip on
    several threads was slowed by its wall time."""
    import agents.techniques.spatial.session as spatial_run

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    session = types.SimpleNamespace(agent=types.SimpleNamespace(emulation=DeviceEmulation(compute_slowdown=6.0)))

    def strip(v):
        compute_clock.run(5e-3, 2e-3)
        return v + 1

    assert spatial_run.SpatialSession._compute(session, strip, 41) == 42
    assert compute_clock.slept == [pytest.approx(7e-3)]


def test_an_agent_told_it_shares_its_host_profiles_its_units_as_on_a_shared_host():
    assert DeviceEmulation(compute_slowdown=8.0, shared_host=True).shares_host("cpu")
    assert DeviceEmulation(memory_budget_bytes=MIB, shared_host=True).shares_host("cpu")
    assert not DeviceEmulation(compute_slowdown=8.0, shared_host=True).shares_host("cuda:0")  # not modelled


def test_a_device_deployed_alone_with_a_memory_budget_profiles_warm():
    """A real device given only a budget keeps its caches between steps: nothing says otherwise."""
    assert not DeviceEmulation(memory_budget_bytes=MIB).shares_host("cpu")
    assert not DeviceEmulation(compute_slowdown=8.0).shares_host("cpu")


def test_the_shared_host_flag_reaches_the_agents_emulation():
    from agents.__main__ import build_parser, emulation_from_args

    base = ["serve", "--device", "d", "--coordinator-key=" + "a" * 40, "--memory-budget-mib", "3"]
    assert emulation_from_args(build_parser().parse_args(base + ["--shared-host"])).shares_host("cpu")
    assert not emulation_from_args(build_parser().parse_args(base)).shares_host("cpu")
