"""A stage checks its budget before it takes memory: the bytes it plans from the checkpoint's
header are what it holds once loaded (every family, every cut, tied heads, an expert buffer),
a refusal reads no tensor, and an agent process refused a shard beyond its budget stays small."""

from __future__ import annotations

import pytest

from agents.emulation import MIB, DeviceEmulation, ShardOverBudget
from agents.protocol import KvReservation
from agents.shard import StageExecutor
from agents.techniques.expert_offload.offload import ExpertOffloadExecutor
from core.models.checkpoints import ModelRecipe, make_model


class _Refused(Exception):
    pass


def _planned(executor_type, model_dir, start, end, **kw):
    seen = []

    def budget(weight_bytes, kv_bytes=0):
        seen.append((weight_bytes, kv_bytes))
        raise _Refused

    with pytest.raises(_Refused):
        executor_type(model_dir, start, end, budget=budget, **kw)
    return seen[0]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("cut", [(0, 6), (0, 2), (2, 5), (5, 6)])
def test_the_bytes_planned_from_the_header_are_the_bytes_the_loaded_stage_holds(tiny_model_dirs, family, cut):
    planned, kv = _planned(StageExecutor, tiny_model_dirs[family], *cut)
    assert kv == 0
    assert planned == StageExecutor(tiny_model_dirs[family], *cut, huge_pages=False).memory_bytes()


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("cut", [(0, 6), (2, 5)])
def test_a_quantized_stage_is_planned_at_its_quantized_size_before_loading(tiny_llama_dir, weights, cut):
    planned, _ = _planned(StageExecutor, tiny_llama_dir, *cut, weights=weights)
    assert planned == StageExecutor(tiny_llama_dir, *cut, weights=weights, huge_pages=False).memory_bytes()
    assert planned < _planned(StageExecutor, tiny_llama_dir, *cut)[0]


def test_a_kv_reservation_is_planned_at_its_allocated_size(tiny_llama_dir):
    reservation = KvReservation(groups=2, sequences=3, context_tokens=20)
    _, kv = _planned(StageExecutor, tiny_llama_dir, 1, 4, kv=reservation)
    assert kv == StageExecutor(tiny_llama_dir, 1, 4, kv=reservation, huge_pages=False).kv_reserved_bytes


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    recipe = ModelRecipe(family="mixtral", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=7,
                         experts=4)
    return str(make_model(recipe, tmp_path_factory.mktemp("budget-moe") / "tiny-mixtral"))


def test_an_expert_stage_plans_its_resident_weights_and_its_full_expert_buffer(mixtral_dir):
    planned, _ = _planned(ExpertOffloadExecutor, mixtral_dir, 0, 4, slots=3)
    executor = ExpertOffloadExecutor(mixtral_dir, 0, 4, slots=3)
    assert planned == executor.resident_bytes() + 3 * executor.expert_bytes() == executor.memory_bytes()


def test_a_shard_beyond_the_budget_is_refused_before_any_tensor_is_read(tiny_llama_dir, monkeypatch):
    from agents import checkpoint_reader

    read = []
    monkeypatch.setattr(checkpoint_reader.CheckpointReader, "read", lambda self, names, dtype: read.append(names))
    check = DeviceEmulation(memory_budget_bytes=MIB // 8).shard_check("edge-a", (0, 6))
    with pytest.raises(ShardOverBudget, match=r"units \[0, 6\) need .* MiB of weights but device edge-a has a 0\.1 MiB"):
        StageExecutor(tiny_llama_dir, 0, 6, budget=check)
    assert read == []


def _peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_an_agent_process_refuses_a_shard_beyond_its_budget_without_taking_its_memory(tmp_path):
    """A ~35 MiB shard on an agent with a 4 MiB budget: refused naming both, its peak RSS grown by
    a fraction of the shard (before the check moved ahead of the load it grew by the whole shard)."""
    from core.devices.local_cluster import LocalCluster
    from core.errors import ShardOverBudget as CoreShardOverBudget
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import Coordinator

    recipe = ModelRecipe(family="llama", layers=4, hidden=384, heads=4, kv_heads=2, vocab=512, seed=7)
    model_dir = str(make_model(recipe, tmp_path / "medium-llama"))
    weights = StageExecutor(model_dir, 0, 6, huge_pages=False).memory_bytes()
    assert weights > 24 * MIB
    emulation = {"big": DeviceEmulation(), "small": DeviceEmulation(memory_budget_bytes=4 * MIB)}
    with LocalCluster(tmp_path / "cluster", ["big", "small"], emulation=emulation) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as co:
        co.wait_ready(30)
        co.load(plan_from_boundaries("medium", 6, ["big", "small"], [5]), model_dir, timeout_s=60)  # its head fits
        co.unload()
        before = _peak_rss(cluster.pid_of("small"))  # the model code imported, a stage loaded and let go
        with pytest.raises(CoreShardOverBudget, match=rf"need {weights / MIB:.1f} MiB of weights but device small "
                                                      r"has a 4\.0 MiB memory budget"):
            co.load(plan_from_boundaries("medium", 6, ["small"], []), model_dir, timeout_s=60)
        grown = _peak_rss(cluster.pid_of("small")) - before
    assert grown < weights / 3, f"peak RSS grew {grown / MIB:.1f} MiB refusing a {weights / MIB:.1f} MiB shard"
