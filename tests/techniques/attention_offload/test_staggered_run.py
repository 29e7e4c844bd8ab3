"""Staggered pipelining run for real (issue 15): 2 compute replicas and 2 memory agents serve 3
batches in the order of the one schedule (agents.schedule.staggered_slices), with the tokens of
HF generate and the timeline the simulator predicts from the same schedule."""

from __future__ import annotations

from collections import Counter

import pytest
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.techniques.attention_offload.heads import HeadShape
from agents.protocol import SamplingSpec
from agents.techniques.attention_offload.schedule import staggered_slices
from core.errors import RunFailed
from core.runs.generation import load_tokenizer
from core.runs.coordinator import RunRequest
from core.techniques.attention_offload.problem import OffloadDevice, OffloadPlan, OffloadProblem, OffloadWorkload
from core.techniques.attention_offload.run import checkpoint_model, run_staggered
from core.techniques.attention_offload.simulator import simulate
from tests.core.hf_reference import hf_greedy_new_tokens, hf_seeded_new_tokens
from tests.core.in_process_agents import in_process_cluster

PROMPTS = ["the cat sat", "a longer prompt about the river", "hello"]
MAX_NEW = 4
COMPUTE, MEMORY = ("c0", "c1"), ("m0", "m1")


@pytest.fixture(scope="module")
def cluster():
    with in_process_cluster([*COMPUTE, *MEMORY]) as (coordinator, agents):
        yield coordinator, {a.device: a for a in agents}


def _request(model_dir, max_new=MAX_NEW):
    enc = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    req = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                     attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())), max_new_tokens=max_new,
                     micro_batches=3, eos_token_ids=(2,), pad_token_id=0, sampling=SamplingSpec())
    return enc, req


def _signature(events, memory=MEMORY):
    """What a run does, whatever its timing: per device and kind, each (step, micro-batch, peer)."""
    return Counter((e.device, e.kind, e.step, e.micro_batch, e.peer if e.kind == "send" else "")
                   for e in events if e.kind in ("compute", "send"))


@pytest.mark.parametrize("schedule", ["rotational", "fixed"])
def test_three_batches_over_two_replicas_give_hf_tokens_and_the_simulated_timeline(cluster, tiny_llama_dir,
                                                                                   schedule):
    coordinator, _ = cluster
    enc, req = _request(tiny_llama_dir)
    result = run_staggered(coordinator, tiny_llama_dir, COMPUTE, MEMORY, req, schedule=schedule)
    assert [list(t) for t in result.tokens] == [list(t) for t in hf_greedy_new_tokens(tiny_llama_dir, enc, MAX_NEW)]
    model = checkpoint_model(tiny_llama_dir)
    device = dict(flops=1e12, memory_bandwidth=1e11, memory_bytes=1 << 40, link_bandwidth=1e9)
    problem = OffloadProblem(devices=tuple(OffloadDevice(id=d, **device) for d in (*COMPUTE, *MEMORY)), model=model,
                             workload=OffloadWorkload(prompt_tokens=enc["input_ids"].shape[1],
                                                      generated_tokens=MAX_NEW))
    sim = simulate(problem, OffloadPlan(compute=COMPUTE, memory=MEMORY, batch=1, in_flight=3, schedule=schedule))
    assert _signature(result.events) == _signature(sim.events)
    assert sorted((t.micro_batch, t.step) for t in result.token_events) == \
        sorted((t.micro_batch, t.step) for t in sim.tokens)


def test_rotational_slices_move_between_replicas_and_fixed_ones_stay(cluster, tiny_llama_dir):
    layers = HeadShape.of(tiny_llama_dir).layers
    rotational = staggered_slices("rotational", 2, 3, MAX_NEW, layers)
    fixed = staggered_slices("fixed", 2, 3, MAX_NEW, layers)
    assert {s.replica for s in rotational if s.micro_batch == 0} == {0, 1}
    assert {s.replica for s in fixed if s.micro_batch == 1 and not s.is_tail} == {1}
    coordinator, _ = cluster
    _, req = _request(tiny_llama_dir, max_new=2)
    result = run_staggered(coordinator, tiny_llama_dir, COMPUTE, MEMORY, req, schedule="rotational")
    moved = [e for e in result.events if e.kind == "send" and e.device in COMPUTE and e.peer in COMPUTE]
    assert moved and all(e.nbytes > 0 for e in moved)


def test_seeded_sampling_over_replicas_gives_transformers_generate_with_the_same_draws(cluster, tiny_llama_dir):
    coordinator, _ = cluster
    enc, req = _request(tiny_llama_dir)
    import dataclasses

    seeded = dataclasses.replace(req, sampling=SamplingSpec(temperature=0.9, top_p=0.9, seed=5))
    two = run_staggered(coordinator, tiny_llama_dir, COMPUTE, MEMORY, seeded, schedule="rotational")
    expected = hf_seeded_new_tokens(tiny_llama_dir, enc, MAX_NEW, [(0,), (1,), (2,)], temperature=0.9, top_p=0.9,
                                    seed=5)  # one prompt per batch, as the run's 3 micro-batches
    assert [tuple(t) for t in two.tokens] == [tuple(t) for t in expected]


def test_an_unknown_schedule_or_a_device_in_both_roles_is_refused(cluster, tiny_llama_dir):
    coordinator, _ = cluster
    _, req = _request(tiny_llama_dir)
    with pytest.raises(RunFailed, match="unknown staggered schedule"):
        run_staggered(coordinator, tiny_llama_dir, COMPUTE, MEMORY, req, schedule="zigzag")
    with pytest.raises(RunFailed, match="different devices"):
        run_staggered(coordinator, tiny_llama_dir, COMPUTE, ("c1", "m0"), req)


def test_a_memory_agent_refuses_a_hold_whose_kv_share_exceeds_its_emulated_budget(tiny_llama_dir):
    from agents.agent import Agent
    from agents.emulation import DeviceEmulation
    from agents.transport import CurveKeys
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from core.techniques.attention_offload.run import run_offload

    keys = CurveKeys.generate()
    # 4 layers·1 head·16 dims·4 bytes·2 (k, v) = 512 B per token of KV on each memory agent: m1 holds 8 tokens
    agents = [Agent("c0", keys.public).start(),
              Agent("m0", keys.public, emulation=DeviceEmulation(memory_budget_bytes=1 << 20)).start(),
              Agent("m1", keys.public, emulation=DeviceEmulation(memory_budget_bytes=1 << 12)).start()]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            _, req = _request(tiny_llama_dir)
            with pytest.raises(RunFailed, match="m1.*KV cache but device m1 has a 0.0 MiB memory budget"):
                run_offload(co, tiny_llama_dir, "c0", ["m0", "m1"], req)
            assert {s.state for s in co.status().values()} <= {"idle", "ready"}
    finally:
        for a in agents:
            a.close()


def test_a_compute_agent_whose_budget_cannot_hold_the_dense_part_is_refused_with_what_would_hold_it(
        tiny_llama_dir):
    from agents.agent import Agent
    from agents.emulation import DeviceEmulation
    from agents.transport import CurveKeys
    from core.errors import ShardOverBudget
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from core.techniques.attention_offload.run import dense_weight_bytes, run_offload

    keys = CurveKeys.generate()
    need = dense_weight_bytes(tiny_llama_dir)
    agents = [Agent("c0", keys.public, emulation=DeviceEmulation(memory_budget_bytes=need // 2)).start(),
              Agent("m0", keys.public).start()]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            _, req = _request(tiny_llama_dir)
            with pytest.raises(ShardOverBudget) as refused:
                run_offload(co, tiny_llama_dir, "c0", ["m0"], req)
            said = str(refused.value)
            assert refused.value.device == "c0" and "attention offloading's compute agent" in said
            assert f"at least {-(-need * 10 // 2**20) / 10:.1f} MiB" in said  # what would hold it
            assert "plan fewer units" not in said  # layer sharding's advice does not apply to a dense stage
    finally:
        for a in agents:
            a.close()


def test_an_emulated_slower_compute_agent_slows_its_dense_segments_itself_with_unchanged_tokens(tiny_llama_dir):
    from agents.agent import Agent
    from agents.techniques.attention_offload.data_plane import DenseAgentExecutor
    from agents.emulation import DeviceEmulation
    from agents.transport import CurveKeys
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from core.techniques.attention_offload.run import run_offload

    keys = CurveKeys.generate()
    agents = [Agent("c0", keys.public, emulation=DeviceEmulation(compute_slowdown=2.0)).start(),
              Agent("m0", keys.public).start()]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            enc, req = _request(tiny_llama_dir)
            result = run_offload(co, tiny_llama_dir, "c0", ["m0"], req)
            assert [list(t) for t in result.tokens] == [list(t) for t in hf_greedy_new_tokens(tiny_llama_dir, enc,
                                                                                              MAX_NEW)]
            # not wrapped in SlowedStage, which stretched the whole step, waits for the memory agent included
            assert type(agents[0]._loaded.executor) is DenseAgentExecutor
    finally:
        for a in agents:
            a.close()


def test_a_memory_agents_answer_that_overtakes_the_start_is_kept_for_its_slice(cluster, tiny_llama_dir):
    """A held replica copies frames that arrive before the source's start out of their zmq frames;
    they are then filed under their batch and slice like any other."""
    import torch

    from agents.techniques.attention_offload.data_plane import _Covers
    from agents.techniques.attention_offload.heads import DenseExecutor, HeadShape
    from agents.techniques.attention_offload.staggered import RunInputs, StaggeredReplica
    from agents.protocol import DataHeader, PeerSpec, options_slot
    from agents.techniques.attention_offload.messages import AttendSpec, ServicePeer
    from agents.transport import tensor_frame

    _, agents = cluster
    shape = HeadShape.of(tiny_llama_dir)
    services = [ServicePeer(device=m, data_address="tcp://127.0.0.1:1", public_key="k" * 40, start=i, stop=i + 1)
                for i, m in enumerate(MEMORY)]
    ex = DenseExecutor(tiny_llama_dir, 0, shape.layers + 2, sides=[_Covers(range(s.start, s.stop)) for s in services])
    run = RunInputs(run_id="r1", micro_batches=((0,),), input_ids=torch.zeros((1, 3), dtype=torch.int64),
                    attention_mask=torch.ones((1, 3), dtype=torch.int64), steps=2, eos=frozenset(), pad=0,
                    sampling=SamplingSpec())
    replicas = [PeerSpec(device=d, stage=i, data_address="tcp://127.0.0.1:1", public_key="k" * 40)
                for i, d in enumerate(COMPUTE)]
    replica = StaggeredReplica(agents["c1"], ex, me=1, schedule="rotational", replicas=replicas, services=services,
                               run=run, stop=None)
    try:
        out = torch.arange(shape.head_dim * shape.group * 3, dtype=torch.float32).reshape(1, 3, shape.group,
                                                                                          shape.head_dim)
        spec, buf = tensor_frame(out)
        header = DataHeader(run_id="r1", kind="attended", phase="prefill", step=0, micro_batch=0, sender="m0",
                            tensors=(spec,), options=options_slot(AttendSpec(layer=1, kv_start=0, kv_stop=1)))
        replica.take(header, [memoryview(bytearray(bytes(buf)))])
        assert torch.equal(replica._inbox[(0, 1)]["out"]["m0"], out)
    finally:
        replica.close()


def test_a_memory_agent_killed_mid_staggered_decode_fails_fast_naming_it_and_the_survivors_run_again(
        tiny_llama_dir, tmp_path):
    """Heartbeats too slow to notice (60 s): the replicas see the memory agent's data connection drop."""
    import dataclasses

    from core.devices.local_cluster import LocalCluster
    from core.errors import MemoryAgentLost
    from core.runs.coordinator import Coordinator
    from tests.techniques.attention_offload.killing import kill_mid_decode

    _, req = _request(tiny_llama_dir, max_new=300)
    req = dataclasses.replace(req, eos_token_ids=())
    with LocalCluster(tmp_path / "cluster", [*COMPUTE, *MEMORY]) as lc, \
            Coordinator(lc.endpoints, lc.keys, heartbeat_timeout_s=60.0) as co:
        co.wait_ready(timeout_s=30)
        error, seconds = kill_mid_decode(co, lc, "m1", lambda: run_staggered(co, tiny_llama_dir, COMPUTE, MEMORY, req))
        assert isinstance(error, MemoryAgentLost) and error.device == "m1" and seconds < 20
        assert "memory agent m1 was lost mid-run" in str(error)
        enc, short = _request(tiny_llama_dir, max_new=3)
        again = run_staggered(co, tiny_llama_dir, COMPUTE, ("m0",), short)
        assert [list(t) for t in again.tokens] == [list(t) for t in hf_greedy_new_tokens(tiny_llama_dir, enc, 3)]


@pytest.mark.parametrize("schedule", ["rotational", "fixed"])
def test_a_batch_whose_every_sequence_hit_eos_stops_costing_compute_and_memory_work(cluster, tiny_llama_dir,
                                                                                     schedule):
    import dataclasses

    coordinator, _ = cluster
    enc, req = _request(tiny_llama_dir, max_new=6)
    free = hf_greedy_new_tokens(tiny_llama_dir, enc, 6)
    assert len(free[0]) == 6, "the tiny model's greedy text must not hit the default EOS for this test"
    eos = free[0][1]  # batch 0 (prompt 0 alone) ends at step 1 at the latest
    ends = free[0].index(eos)
    req = dataclasses.replace(req, eos_token_ids=(eos,))
    result = run_staggered(coordinator, tiny_llama_dir, COMPUTE, MEMORY, req, schedule=schedule)
    assert [list(t) for t in result.tokens] == \
        [list(t) for t in hf_greedy_new_tokens(tiny_llama_dir, enc, 6, eos_token_id=eos)]
    batch0 = [e for e in result.events if e.micro_batch == 0 and e.kind == "compute"]
    assert max(e.step for e in batch0) == ends  # no slice of a later step anywhere
    assert not [e for e in batch0 if e.device in MEMORY and e.step >= ends + 1]
    for b in (1, 2):  # the batches that did not finish early run every step, on every memory agent
        if len(result.tokens[b]) == 6:
            assert {e.device for e in result.events if e.micro_batch == b and e.kind == "compute"
                    and e.step == 5} >= set(MEMORY)
