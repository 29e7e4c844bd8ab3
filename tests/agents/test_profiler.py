"""The on-device compute profiler: synthetic weights, one unit at a time, robust figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from agents.cold_profiling import MemoryFigures, memory_budget
from agents.profiler import profile_units
from agents.protocol import ComputeOptions

MIB = 1 << 20
PLENTY = MemoryFigures(available_bytes=16 << 30)
"""Memory that bounds nothing a test profiles: no test depends on the host's."""

TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


BLOCK_BYTES = 2 * (64 * 64 + 64 * 32) * 4 + 3 * 64 * 128 * 4 + 2 * 64 * 4  # TINY_LLAMA's: q/o, k/v (GQA), mlp, norms


TINY_MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                    num_local_experts=4, num_experts_per_tok=2)


def test_a_moe_block_also_gets_one_experts_time_and_other_units_none():
    r = profile_units(ComputeOptions(config=TINY_MIXTRAL, prompt_tokens=8, batch_sizes=(1,), repeats=3, warmup=1))
    assert [u.expert_decode_s > 0 for u in r.units] == [False, True, True, False]
    assert all(u.expert_decode_s == 0 for u in profile_units(ComputeOptions(
        config=TINY_LLAMA, prompt_tokens=4, batch_sizes=(1,), repeats=1, warmup=0)).units)


def test_every_unit_gets_decode_and_prefill_medians_with_their_spread():
    r = profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=16, batch_sizes=(1, 2), repeats=3, warmup=1,
                                     prefill_batch_sizes=(1, 2)))
    assert [u.unit for u in r.units] == [0, 1, 2, 3]
    assert r.decode_batch_sizes == (1, 2) and r.prefill_token_counts == (16, 32)
    for u in r.units:
        assert len(u.decode_s) == 2 and len(u.prefill_s) == 2
        assert all(t > 0 for t in u.decode_s + u.prefill_s)
        assert all(s >= 0 for s in u.decode_spread + u.prefill_spread)


def test_a_block_is_timed_without_building_its_mask_or_rotary_embedding(monkeypatch):
    """The runtime builds the causal mask and rotary embedding once per stage, not per
    block: the timed block forward must not include them (they are the stage overhead)."""
    import torch
    import transformers.masking_utils as mu

    from agents.profiler import _hf_config, _UnitBench

    calls = []
    real = mu.create_causal_mask
    monkeypatch.setattr(mu, "create_causal_mask", lambda **kw: calls.append("mask") or real(**kw))
    with torch.inference_mode():
        bench = _UnitBench(_hf_config(TINY_LLAMA), 1, torch.float32, 0)
        real_rotary = bench.rotary_table.embeddings  # the stage's table (agents.step_inputs.RotaryTable)
        bench.rotary_table.embeddings = lambda *a, **kw: calls.append("rotary") or real_rotary(*a, **kw)
        for timed in (bench.decode_fn(2, 8), bench.prefill_fn(1, 8)):
            calls.clear()
            for _ in range(3):
                timed.reset()
                timed.run()
            assert calls == []
        from agents.step_inputs import RotaryTable

        table = RotaryTable.embeddings  # the stage's own table: StageExecutor.of_blocks builds it
        monkeypatch.setattr(RotaryTable, "embeddings", lambda *a, **kw: calls.append("rotary") or table(*a, **kw))
        overhead, _ = bench.stage_decode_overhead_fn(1, 8)
        calls.clear()
        overhead.run()
        # the stage overhead is what the runtime does per step: the rotary embedding, and the
        # mask through agents.shard.DecodeMasks (the factory only until its answer was learnt)
        assert "rotary" in calls and set(calls) <= {"mask", "rotary"}


def test_the_stage_overhead_is_the_stages_own_decode_step_less_its_blocks_call(monkeypatch):
    """What the stage overhead times is ``StageExecutor.decode`` itself (its input check, the mask's growth,
    positions, mask and rotary inputs), not a copy of some of its calls; its clock leaves the block's call out
    (that is the unit's time): a block that takes 50 ms more leaves the overhead's reading unmoved by it."""
    import time

    import torch

    from agents import step_inputs
    from agents.profiler import _hf_config, _UnitBench
    from agents.shard import StageExecutor

    calls = []
    check, run_block = StageExecutor._check_input, step_inputs.run_block
    monkeypatch.setattr(StageExecutor, "_check_input", lambda *a: calls.append("check") or check(*a))
    monkeypatch.setattr(step_inputs, "run_block", lambda *a: calls.append("block") or time.sleep(0.05) or run_block(*a))
    with torch.inference_mode():
        bench = _UnitBench(_hf_config(TINY_LLAMA), 1, torch.float32, 0)
        overhead, less_blocks = bench.stage_decode_overhead_fn(2, 8)
        calls.clear()
        wall = time.perf_counter()  # the wall span encloses the reading's: a preemption between them widens it only
        start = less_blocks()
        out = overhead.run()
        outside = less_blocks() - start
        wall = time.perf_counter() - wall
    assert calls == ["check", "block"] and out.shape == (2, 1, 64)
    assert wall >= 0.05 and outside < wall - 0.045  # the block's 50 ms are not in the reading


def test_decode_repeats_see_the_same_context_length():
    import torch

    from agents.profiler import _hf_config, _UnitBench

    with torch.inference_mode():
        bench = _UnitBench(_hf_config(TINY_LLAMA), 1, torch.float32, 0)
        timed = bench.decode_fn(1, 8)
        for _ in range(3):
            timed.reset()
            out = timed.run()
            assert out.shape == (1, 1, 64)
        # the cache the block reads is back at 8 tokens before each run: 9 after one
        lengths = [c.cell_contents.get_seq_length() for c in timed.run.__closure__
                   if hasattr(c.cell_contents, "get_seq_length")]
        assert lengths == [9]


def test_the_once_per_stage_overhead_is_measured_beside_the_units():
    r = profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=8, batch_sizes=(1,), repeats=3, warmup=1))
    assert r.stage_decode_overhead_s > 0 and r.stage_prefill_overhead_s > 0
    # without a decoder block among the units there is no such work to time
    r = profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=8, batch_sizes=(1,), repeats=3, warmup=1,
                                     units=(0, 3)))
    assert r.stage_decode_overhead_s == 0.0 and r.stage_prefill_overhead_s == 0.0


def test_unit_weights_add_up_to_the_whole_hf_model():
    import transformers

    from agents.profiler import _hf_config

    r = profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=4, batch_sizes=(1,), repeats=1, warmup=0))
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(TINY_LLAMA))
    assert sum(u.param_bytes for u in r.units) == sum(p.numel() * 4 for p in model.parameters())


def test_gpt2_units_include_position_embeddings_and_tied_head():
    cfg = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    r = profile_units(ComputeOptions(config=cfg, prompt_tokens=8, batch_sizes=(1,), repeats=1, warmup=0))
    assert len(r.units) == 4
    assert r.units[0].param_bytes == (256 + 128) * 64 * 4  # wte + wpe


def test_memory_budget_is_available_memory_minus_headroom():
    meminfo = lambda: {"MemTotal": 8 << 30, "MemAvailable": 3 << 30}  # noqa: E731
    assert memory_budget(256 << 20, meminfo=meminfo) == ((3 << 30) - (256 << 20), 8 << 30, 3 << 30)
    assert memory_budget(4 << 30, meminfo=meminfo)[0] == 0  # never negative


def test_meminfo_lines_are_read_in_bytes():
    from agents.cold_profiling import parse_meminfo

    text = "MemTotal:       24576000 kB\nMemAvailable:    1024 kB\nHugePages_Total:       0\n"
    assert parse_meminfo(text) == {"MemTotal": 24576000 * 1024, "MemAvailable": 1024 * 1024, "HugePages_Total": 0}


def test_bad_options_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="outside"):
        profile_units(ComputeOptions(config=TINY_LLAMA, units=(7,)))
    with pytest.raises(ValueError, match="model_type"):
        profile_units(ComputeOptions(config={"hidden_size": 8}))
    with pytest.raises(ValueError, match="device"):
        profile_units(ComputeOptions(config=TINY_LLAMA, device="tpu"))


_UNDER_LIMIT = textwrap.dedent(
    """
    import json, resource, sys
    import torch, transformers
    from agents.profiler import profile_units, _hf_config
    from agents.protocol import ComputeOptions
    cfg = json.loads(sys.argv[1]); headroom = int(sys.argv[2])
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    # the fresh machine of issue 25: sysfs reports a 480 MiB last-level cache; its agents share the host
    r = profile_units(ComputeOptions(config=cfg, prompt_tokens=4, batch_sizes=(1,), repeats=1, warmup=0, threads=1),
                      cache_bytes=480 << 20, shared_host=True)
    total = sum(u.param_bytes for u in r.units)
    try:
        transformers.AutoModelForCausalLM.from_config(_hf_config(cfg))
        whole = "fits"
    except (MemoryError, RuntimeError):
        whole = "does not fit"
    print(json.dumps({"units": len(r.units), "total": total, "whole": whole, "timing": r.cache_timing}))
    """
)


def test_a_model_larger_than_the_memory_limit_is_profiled_one_unit_at_a_time():
    """Address space limited to 400 MiB more than the interpreter uses: the 0.9 GB model
    cannot be built whole there (checked), yet every unit gets profiled — also under a 480 MiB
    last-level cache on a shared host, whose cold copies (256 MiB) and evictor (960 MiB) ended in
    ``DefaultCPUAllocator: can't allocate memory`` (issue 25): the units are timed warm, saying why."""
    cfg = dict(model_type="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
               num_attention_heads=8, num_key_value_heads=8, vocab_size=8000, max_position_embeddings=256)
    # One compute thread and one malloc arena: each extra thread reserves address space (its
    # stack, a 64 MiB arena) that the limit counts, so the margin must not depend on the host.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
    proc = subprocess.run([sys.executable, "-c", _UNDER_LIMIT, json.dumps(cfg), str(400 << 20)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["units"] == 14
    assert out["total"] > 2 * (400 << 20)
    assert out["whole"] == "does not fit"
    assert out["timing"].startswith("warm: ") and "480 MiB last-level cache" in out["timing"]
    assert "RLIMIT_AS" in out["timing"]


def test_the_result_crosses_the_wire_as_a_typed_profile_and_decodes_equal():
    from agents.profiler import profile_compute
    from agents.protocol import ComputeProfile, ProfileResult, decode_control, encode_control

    class FakeAgent:
        device = "dev-a"

    out = profile_compute(FakeAgent(), ComputeOptions(config=TINY_LLAMA, repeats=1, warmup=0, batch_sizes=(1,)))
    assert isinstance(out, ComputeProfile) and out.device == "dev-a" and len(out.units) == 4
    back = decode_control(encode_control(ProfileResult(req=3, result=out)))  # what the coordinator decodes
    assert isinstance(back, ProfileResult) and back.result == out


def test_cold_copies_span_twice_the_cache_only_when_the_model_does_not_fit_in_it():
    from agents.cold_profiling import cold_copies

    mib = 1 << 20
    block = 12_849_152  # the miniature's (hidden 512) of a 102 MiB model under a 32 MiB L3: 6 copies, 74 MiB
    assert cold_copies(block, 102 * mib, 32 * mib) == 6
    assert cold_copies(block, 30 * mib, 32 * mib) == 1  # the whole model stays cached: warm, as it runs
    assert cold_copies(70 * mib, 900 * mib, 32 * mib) == 1  # a unit twice the cache evicts itself
    # twice a 480 MiB cache does not fit in 256 MiB: copies the cache would hold are not built
    assert cold_copies(1 * mib, 900 * mib, 480 * mib, max_bytes=256 * mib) == 1
    assert cold_copies(1 * mib, 900 * mib, 128 * mib, max_bytes=256 * mib) == 256
    assert cold_copies(1 * mib, 900 * mib, 0) == 1  # cache size unknown: as before


def test_sysfs_cache_sizes_are_read_in_bytes():
    from agents.cold_profiling import parse_cache_size

    assert parse_cache_size("32768K\n") == 32 << 20
    assert parse_cache_size("1M") == 1 << 20
    assert parse_cache_size("512") == 512
    assert parse_cache_size("") == 0 and parse_cache_size("big") == 0


def test_the_last_level_cache_is_the_largest_data_cache_sysfs_lists(tmp_path):
    from agents.cold_profiling import last_level_cache_bytes

    for index, kind, size in (("index0", "Data", "48K"), ("index1", "Instruction", "999M"),
                              ("index2", "Unified", "2048K"), ("index3", "Unified", "491520K")):
        (tmp_path / "cache" / index).mkdir(parents=True)
        (tmp_path / "cache" / index / "type").write_text(kind + "\n")
        (tmp_path / "cache" / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(str(tmp_path)) == 480 * MIB
    assert last_level_cache_bytes(str(tmp_path / "nowhere")) == 0


def _timed_benches(monkeypatch, cache_bytes: int, memory: MemoryFigures = PLENTY,
                   seen: list | None = None) -> dict[int, list[int]]:
    """Profile TINY_LLAMA with a last-level cache of ``cache_bytes`` and ``memory``; per unit, which
    copy (its construction order) each timed decode call ran on (the profile appended to ``seen``)."""
    import agents.profiler as profiler
    from agents.cold_profiling import Timed

    calls: dict[int, list[int]] = {}
    built: dict[int, int] = {}

    class Recording(profiler._UnitBench):
        def __init__(self, cfg, unit, *a, **kw):
            super().__init__(cfg, unit, *a, **kw)
            self.unit, self.copy = unit, built.get(unit, 0)
            built[unit] = self.copy + 1

        def decode_fn(self, b, context):
            timed = super().decode_fn(b, context)

            def run():
                calls.setdefault(self.unit, []).append(self.copy)
                return timed.run()

            return Timed(run, timed.reset)

    monkeypatch.setattr(profiler, "_UnitBench", Recording)
    r = profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=8, batch_sizes=(1,), repeats=6, warmup=1),
                      cache_bytes=cache_bytes, memory=memory)
    if seen is not None:
        seen.append(r)
    return calls


def test_a_block_of_a_model_larger_than_the_cache_is_timed_on_copies_in_turn(monkeypatch):
    """What made the miniature's edge-only predictions 2.5x too fast: one block timed over and
    over stays in the L3 cache, while a run streams every block of the stage through it."""
    calls = _timed_benches(monkeypatch, cache_bytes=BLOCK_BYTES + 1)  # the model (~0.4 MiB) does not fit
    for unit in (1, 2):  # each block: 3 copies (2 x cache / block, rounded up), used in turn, warm-up included
        assert calls[unit] == [i % 3 for i in range(len(calls[unit]))] and len(calls[unit]) >= 6
    assert set(calls[0]) == {0}  # the embedding: a step reads its tokens' rows only


def test_a_cold_profile_stays_cold_when_memory_allows_the_copies(monkeypatch):
    seen: list = []
    # the blocks' 3 copies (~0.45 MiB) fit in what 512 MiB of headroom leaves of 513 MiB available
    calls = _timed_benches(monkeypatch, cache_bytes=BLOCK_BYTES + 1, seen=seen,
                           memory=MemoryFigures(available_bytes=513 * MIB, address_space_room_bytes=520 * MIB))
    assert set(calls[1]) == set(calls[2]) == {0, 1, 2}
    assert seen[0].cache_timing == "cold"


def test_without_memory_for_the_copies_units_are_timed_warm_once_and_the_profile_says_why(monkeypatch):
    seen: list = []
    calls = _timed_benches(monkeypatch, cache_bytes=BLOCK_BYTES + 1, seen=seen,
                           memory=MemoryFigures(available_bytes=(512 << 20) + BLOCK_BYTES))  # room for one copy
    assert all(set(c) == {0} for c in calls.values())  # no copy built
    assert seen[0].cache_timing.startswith("warm: ") and "MemAvailable less 512 MiB of headroom" in seen[0].cache_timing


def test_a_huge_cache_on_a_shared_host_with_little_memory_builds_no_evictor_and_says_so(monkeypatch):
    """The fresh machine of issue 25 (480 MiB of L3), with 600 MiB available: the evictor would write
    960 MiB. Every unit is still profiled, warm, and the profile says so."""
    import agents.profiler as profiler

    made = []
    monkeypatch.setattr(profiler, "CacheEvictor", lambda n: made.append(n))
    r = profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=8, batch_sizes=(1,), repeats=1, warmup=0),
                      cache_bytes=480 * MIB, shared_host=True, memory=MemoryFigures(available_bytes=600 * MIB))
    assert made == [] and [u.unit for u in r.units] == [0, 1, 2, 3]
    assert r.cache_timing == ("warm: overwriting the 480 MiB last-level cache takes 960 MiB; profiling may add "
                              "88 MiB (MemAvailable less 512 MiB of headroom)")


def test_how_a_unit_is_timed_is_bounded_by_the_room_and_the_caps():
    from agents.cold_profiling import RING_MAX_BYTES, Room, evictor_bytes, unit_cold

    block, model, plenty = 64 * MIB, 900 * MIB, Room(64 << 30, "MemAvailable")
    assert unit_cold(12 * MIB, 102 * MIB, 32 * MIB, plenty) == (6, False, "")  # 72 MiB of copies: cold
    assert unit_cold(block, model, 32 * MIB, Room(0, "none")) == (1, False, "")  # evicts itself: cold
    huge = unit_cold(block, model, 480 * MIB, plenty)  # 960 MiB of copies: beyond the cap
    assert huge.copies == 1 and "profiling may add 256 MiB (the copies cap)" in huge.warm
    short = unit_cold(12 * MIB, 102 * MIB, 32 * MIB, Room(50 * MIB, "the address-space limit (RLIMIT_AS)"))
    assert short.copies == 1 and "may add 50 MiB (the address-space limit (RLIMIT_AS))" in short.warm
    assert evictor_bytes(32 * MIB, plenty, shared_host=True) == 64 * MIB
    assert evictor_bytes(32 * MIB, Room(63 * MIB, "x"), shared_host=True) == 0  # beyond the room
    assert evictor_bytes(480 * MIB, plenty, shared_host=True) == 0  # beyond the cap
    assert evictor_bytes(32 * MIB, plenty, shared_host=False) == 0
    # copies share the room with the evictor: what it holds is not theirs
    assert unit_cold(12 * MIB, 102 * MIB, 32 * MIB, Room(100 * MIB, "x"), evictor=64 * MIB, shared_host=True) \
        == (1, True, "")
    assert RING_MAX_BYTES == 256 * MIB


def test_the_room_is_the_least_limit_less_the_headroom():
    from agents.cold_profiling import profiling_room

    room = profiling_room(MemoryFigures(available_bytes=8 << 30, address_space_room_bytes=700 * MIB,
                                        cgroup_room_bytes=2 << 30), 512 * MIB)
    assert room.bytes == 188 * MIB and room.bound == "the address-space limit (RLIMIT_AS) less 512 MiB of headroom"
    assert profiling_room(MemoryFigures(available_bytes=100 * MIB), 512 * MIB).bytes == 0
    assert profiling_room(MemoryFigures(available_bytes=None), 512 * MIB).bound == "no memory limit"


@pytest.mark.parametrize("line, files, room", [
    ("0::/agent", {"agent/memory.max": "1073741824", "agent/memory.current": "268435456"}, 768 * MIB),  # v2
    ("0::/agent", {"agent/memory.max": "max", "agent/memory.current": "1"}, None),  # v2, no limit
    ("4:memory:/agent", {"memory/agent/memory.limit_in_bytes": "536870912",
                         "memory/agent/memory.usage_in_bytes": "134217728"}, 384 * MIB),  # v1
    ("4:memory:/agent", {"memory/agent/memory.limit_in_bytes": "9223372036854771712",
                         "memory/agent/memory.usage_in_bytes": "1"}, None),  # v1, no limit
], ids=["v2", "v2-max", "v1", "v1-unlimited"])
def test_the_memory_cgroups_room_is_its_limit_less_its_usage(tmp_path, line, files, room):
    from agents.cold_profiling import cgroup_room

    (tmp_path / "cgroup").write_text(f"9:pids:/\n{line}\n")
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == room


def test_the_profile_summary_says_which_units_were_timed_warm():
    from agents.cold_profiling import cache_timing

    assert cache_timing(["", ""]) == "cold"
    assert cache_timing(["fits", "fits"]) == "warm: fits"
    assert cache_timing(["", "no room", "no room"]) == "warm: 2 of 3 units: no room"


def test_a_model_that_fits_in_the_cache_is_timed_warm_on_one_copy(monkeypatch):
    calls = _timed_benches(monkeypatch, cache_bytes=64 << 20)
    assert all(set(c) == {0} for c in calls.values())


def _calls_on_a_shared_host(monkeypatch, cache_bytes: int) -> list[str]:
    """Profile TINY_LLAMA on a shared host with a last-level cache of ``cache_bytes``: the order
    of cache evictions ("evict") and timed decode calls ("unit N")."""
    import agents.profiler as profiler
    from agents.cold_profiling import Timed

    order: list[str] = []

    class Evictor:
        def __init__(self, nbytes):
            pass

        def __call__(self):
            order.append("evict")

    class Recording(profiler._UnitBench):
        def __init__(self, cfg, unit, *a, **kw):
            super().__init__(cfg, unit, *a, **kw)
            self._unit = unit

        def decode_fn(self, b, context):
            timed = super().decode_fn(b, context)
            name = f"unit {self._unit}"

            def run():
                order.append(name)
                return timed.run()

            return Timed(run, timed.reset)

        def prefill_fn(self, b, prompt_tokens):
            return _recorded(super().prefill_fn(b, prompt_tokens), f"prefill {self._unit}")

        def stage_decode_overhead_fn(self, b, context, *timing):
            timed, clock = super().stage_decode_overhead_fn(b, context, *timing)
            return _recorded(timed, "overhead"), clock

        def stage_prefill_overhead_fn(self, b, prompt_tokens, *timing):
            timed, clock = super().stage_prefill_overhead_fn(b, prompt_tokens, *timing)
            return _recorded(timed, "overhead"), clock

    def _recorded(timed, name):
        return timed._replace(run=lambda: (order.append(name), timed.run())[1])

    monkeypatch.setattr(profiler, "CacheEvictor", Evictor)
    monkeypatch.setattr(profiler, "_UnitBench", Recording)
    profile_units(ComputeOptions(config=TINY_LLAMA, prompt_tokens=8, batch_sizes=(1,), repeats=3, warmup=1),
                  cache_bytes=cache_bytes, shared_host=True, memory=PLENTY)
    return order


def test_on_a_shared_host_a_unit_the_cache_holds_is_timed_after_the_cache_was_overwritten(monkeypatch):
    """What the demo's 8x head stage measured 5x its prediction for: other agents compute on the
    host between two of its steps, so its head never finds its weights (or the code) in the cache."""
    order = _calls_on_a_shared_host(monkeypatch, cache_bytes=64 << 20)  # the model (~0.4 MiB) fits
    for u in range(4):  # warmup=1 then repeats=3: each timed call right after an eviction
        runs = [i for i, c in enumerate(order) if c == f"unit {u}"]
        assert len(runs) == 4 and all(order[i - 1] == "evict" for i in runs[1:])


def test_on_a_shared_host_warm_up_calls_are_not_evicted_for(monkeypatch):
    """A warm-up's time is dropped and the next timed call is evicted for anyway: evicting before
    warm-ups cost the demo's agents 37 % of their evictions for nothing."""
    order = _calls_on_a_shared_host(monkeypatch, cache_bytes=64 << 20)
    calls = [i for i, c in enumerate(order) if c != "evict"]
    # per unit and phase: 1 warm-up then 3 timed calls (the stage overhead: 1 then 20), each timed one evicted for
    assert order.count("evict") == sum(order[i - 1] == "evict" for i in calls) == 4 * 3 * 2 + 20 * 2
    for name in [f"unit {u}" for u in range(4)] + [f"prefill {u}" for u in range(4)]:
        assert order[order.index(name) - 1] != "evict"


def test_on_a_shared_host_units_timed_on_copies_are_not_evicted_again(monkeypatch):
    order = _calls_on_a_shared_host(monkeypatch, cache_bytes=BLOCK_BYTES + 1)  # the model does not fit
    for unit in ("unit 1", "unit 2"):  # their copies take turns: nothing overwrites the cache between calls
        runs = [i for i, c in enumerate(order) if c == unit]
        assert len(runs) >= 4 and "evict" not in order[runs[0]:runs[-1]]


def test_a_profiled_decode_step_calls_blocks_and_the_rotary_embedding_as_a_stage_does(tiny_llama_dir, monkeypatch):
    """One code path: in a steady decode step, a stage of two blocks (the reference) and the profiler's block
    and stage-overhead timings go through a block's ``Module.__call__`` and the rotary module equally often
    (a stage: neither, it calls the block's forward and looks its table up); a copy in the profiler that
    called both each step made its profile overestimate the step."""
    from collections import Counter

    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from agents.profiler import _hf_config, _UnitBench
    from agents.shard import StageExecutor

    counts: Counter = Counter()
    module_call, rotary_forward = torch.nn.Module.__call__, LlamaRotaryEmbedding.forward
    monkeypatch.setattr(LlamaDecoderLayer, "__call__",
                        lambda self, *a, **kw: counts.update(["block __call__"]) or module_call(self, *a, **kw))
    monkeypatch.setattr(LlamaRotaryEmbedding, "forward",
                        lambda self, *a, **kw: counts.update(["rotary module"]) or rotary_forward(self, *a, **kw))
    steps, rows, context = 3, 2, 6
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    stage = StageExecutor(tiny_llama_dir, 1, 3)  # blocks 0 and 1
    stage.prefill(0, torch.randn(rows, context, hidden), torch.ones(rows, context, dtype=torch.long))
    stage.decode(0, torch.randn(rows, 1, hidden))  # the first decode step learns the mask and checks the table
    counts.clear()
    for _ in range(steps):
        stage.decode(0, torch.randn(rows, 1, hidden))
    per_stage_step = {"block __call__": counts["block __call__"] / (2 * steps),
                      "rotary module": counts["rotary module"] / steps}
    with torch.inference_mode():
        bench = _UnitBench(_hf_config(config), 1, torch.float32, 0)
        block, (overhead, _) = bench.decode_fn(rows, context), bench.stage_decode_overhead_fn(rows, context)

        def profiled_step() -> None:
            block.reset()
            block.run()
            overhead.run()

        profiled_step()  # a warm-up, as the profiler's
        counts.clear()
        for _ in range(steps):
            profiled_step()
    per_profiled_step = {"block __call__": counts["block __call__"] / steps,
                         "rotary module": counts["rotary module"] / steps}
    assert per_profiled_step == per_stage_step
