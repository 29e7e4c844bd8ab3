"""A real attention-offloading (Lamina) run on agents: the dense side and the memory sides are agents.

The compute device's agent loads the whole model's dense part as stage kind
``attention-offload-dense`` (``Coordinator.load(kind=..., services=...)``: one stage, its
``LoadShard.services`` name the memory agents and the key/value heads each holds); each memory
agent gets a ``HoldHeads`` (its heads, the dense agent's data address and key) and serves
attention over its KV cache. Per layer, q and the new k, v of each side's heads go from the
dense agent's data socket straight to the memory agents', and the outputs come back the same
way (agents.attention_offload): nothing per token passes through this process. The coordinator
runs it like any plan (``Coordinator.run``: tokens, the live sink, the run state), so recording,
replay and the timeline take it as they take layer sharding; the memory agents stream their own
attention and send spans into the same run. The run stops the holds after the stage (their last events arrive first); however it ends, they are stopped.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from collections.abc import Sequence

import msgspec

from agents.protocol import ErrorReply, HoldDense, HoldHeads, Ok, PeerSpec, ServicePeer, StaggeredSpec, StopRun
from core.devices.agent_link import refusal
from core.errors import RunFailed
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.reporting import Reporter
from core.runs.coordinator import Coordinator, RunRequest, RunResult, RunSink
from agents.attention_offload import DENSE_KIND
from core.techniques.attention_offload.problem import OffloadModel

HOLD_TIMEOUT_S = 120.0


def head_ranges(kv_heads: int, memory: int) -> list[tuple[int, int]]:
    """Key/value heads over ``memory`` agents, balanced by heads (``agents.attention_offload.split_heads``)."""
    from agents.attention_offload import split_heads

    return [(r.start, r.stop) for r in split_heads(kv_heads, memory)]


def checkpoint_model(model_dir: str, bytes_per_element: int = 4) -> OffloadModel:
    """The cost model's view of a checkpoint (what a run on it is predicted with)."""
    from agents.checkpoint_reader import load_config

    config = load_config(model_dir)
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    return OffloadModel(name=str(model_dir), layers=int(config.num_hidden_layers), hidden=hidden, q_heads=heads,
                        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
                        intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
                        vocab=int(config.vocab_size), bytes_per_element=bytes_per_element)


def dense_plan(model: str, layers: int, dense_device: str) -> ShardPlan:
    """The one dense stage: every unit (embedding, blocks, head) on the compute device."""
    plan = plan_from_boundaries(model, layers + 2, [dense_device], [])
    return msgspec.structs.replace(plan, stages=tuple(msgspec.structs.replace(s, kind=DENSE_KIND)
                                                      for s in plan.stages))


def run_offload(coordinator: Coordinator, model_dir: str, dense_device: str, memory_devices: Sequence[str],
                request: RunRequest, *, sink: RunSink | None = None, reporter: Reporter | None = None,
                dtype: str = "float32", threads: int = 0) -> RunResult:
    """Load the dense stage, hold the heads on the memory agents, run ``request``; ``RunFailed``
    names the device when one fails, or says there are more memory agents than key/value heads."""
    from agents.attention_offload import HeadShape

    memory = list(memory_devices)
    if not memory:
        raise RunFailed("attention offloading needs at least one memory agent")
    if dense_device in memory or len(set(memory)) != len(memory):
        raise RunFailed("the compute agent and the memory agents must be different devices, each once")
    from agents.checkpoint_reader import CheckpointError

    try:
        shape = HeadShape.of(model_dir)
        ranges = head_ranges(shape.kv_heads, len(memory))
    except CheckpointError as err:
        raise RunFailed(str(err)) from None
    plan = dense_plan(Path(model_dir).name, shape.layers, dense_device)
    kv = _kv_needed(request, plan)
    statuses = coordinator.status_of([dense_device, *memory])
    services = tuple(ServicePeer(device=d, data_address=statuses[d].data_address,
                                 public_key=statuses[d].public_key, start=a, stop=b)
                     for d, (a, b) in zip(memory, ranges))
    coordinator.load(plan, str(model_dir), dtype=dtype, threads=threads, kind=DENSE_KIND,
                     services={dense_device: services}, reporter=reporter)
    dense = PeerSpec(device=dense_device, stage=0, data_address=statuses[dense_device].data_address,
                     public_key=statuses[dense_device].public_key)
    hold_id = uuid.uuid4().hex[:12]
    lease = max(10.0, 4 * coordinator.link.heartbeat_interval_s)
    held: list[str] = []
    try:
        futs = [(d, coordinator.request_async(d, HoldHeads(run_id=hold_id, model_dir=str(model_dir), kv_start=a,
                                                             kv_stop=b, dense=(dense,), lease_s=lease, kv=kv)))
                for d, (a, b) in zip(memory, ranges)]
        for d, fut in futs:
            reply = coordinator.link.await_reply(d, fut, HOLD_TIMEOUT_S, "holding attention heads")
            if isinstance(reply, ErrorReply):
                raise refusal(reply, "holding attention heads: refused", d)
            if not isinstance(reply, Ok):
                raise RunFailed(f"holding attention heads: unexpected answer {type(reply).__name__}", d)
            held.append(d)
        return coordinator.run(plan, request, sink=sink, reporter=reporter, helpers={d: hold_id for d in held})
    finally:
        _release(coordinator, held, hold_id)


def run_staggered(coordinator: Coordinator, model_dir: str, compute_devices: Sequence[str],
                  memory_devices: Sequence[str], request: RunRequest, *, schedule: str = "rotational",
                  sink: RunSink | None = None, reporter: Reporter | None = None, dtype: str = "float32",
                  threads: int = 0) -> RunResult:
    """Lamina's staggered pipelining on agents: ``request.micro_batches`` batches over the compute
    replicas ``compute_devices`` (each holds the whole dense part; the first is the run's source
    stage, the others are held with ``HoldDense``) sharing the memory agents, in the order
    ``agents.schedule.staggered_slices(schedule, ...)`` gives (the simulator's). ``RunFailed`` names
    a device that fails or refuses (an emulated memory budget too small for the dense part)."""
    from agents.attention_offload import HeadShape
    from agents.checkpoint_reader import CheckpointError
    from agents.schedule import STAGGERED_SCHEDULES
    from core.runs.batching import run_micro_batches

    compute, memory = list(compute_devices), list(memory_devices)
    if schedule not in STAGGERED_SCHEDULES:
        raise RunFailed(f"unknown staggered schedule {schedule!r}: one of {', '.join(STAGGERED_SCHEDULES)}")
    if not compute or not memory:
        raise RunFailed("staggered attention offloading needs at least one compute and one memory agent")
    if len(set(compute + memory)) != len(compute) + len(memory):
        raise RunFailed("the compute agents and the memory agents must be different devices, each once")
    try:
        shape = HeadShape.of(model_dir)
        ranges = head_ranges(shape.kv_heads, len(memory))
    except CheckpointError as err:
        raise RunFailed(str(err)) from None
    plan = dense_plan(Path(model_dir).name, shape.layers, compute[0])
    groups = run_micro_batches(len(request.input_ids), plan, request.micro_batches)
    statuses = coordinator.status_of(compute + memory)
    services = tuple(ServicePeer(device=d, data_address=statuses[d].data_address,
                                 public_key=statuses[d].public_key, start=a, stop=b)
                     for d, (a, b) in zip(memory, ranges))
    replicas = tuple(PeerSpec(device=d, stage=i, data_address=statuses[d].data_address,
                              public_key=statuses[d].public_key) for i, d in enumerate(compute))
    spec = StaggeredSpec(schedule=schedule, replicas=replicas)
    coordinator.load(plan, str(model_dir), dtype=dtype, threads=threads, kind=DENSE_KIND,
                     services={compute[0]: services}, reporter=reporter)
    hold_id = uuid.uuid4().hex[:12]
    lease = max(10.0, 4 * coordinator.link.heartbeat_interval_s)
    held: list[str] = []
    try:
        kv = _kv_needed(dataclasses.replace(request, micro_batches=len(groups)), plan)
        asks = [(d, HoldHeads(run_id=hold_id, model_dir=str(model_dir), kv_start=a, kv_stop=b, dense=replicas,
                              lease_s=lease, kv=kv), "holding attention heads") for d, (a, b) in zip(memory, ranges)]
        asks += [(d, HoldDense(run_id=hold_id, model_dir=str(model_dir), replica=i, staggered=spec,
                               services=services, micro_batches=groups, input_ids=request.input_ids,
                               attention_mask=request.attention_mask, max_new_tokens=request.max_new_tokens,
                               eos_token_ids=request.eos_token_ids, pad_token_id=request.pad_token_id,
                               sampling=request.sampling, dtype=dtype, threads=threads, lease_s=lease),
                  "loading a dense replica") for i, d in enumerate(compute) if i > 0]
        futs = [(d, coordinator.request_async(d, msg), what) for d, msg, what in asks]
        refused: RunFailed | None = None
        for d, fut, what in futs:  # every answer first, so each hold that started is ended
            try:
                reply = coordinator.link.await_reply(d, fut, HOLD_TIMEOUT_S, what)
            except RunFailed as err:
                refused = refused or err
                continue
            if isinstance(reply, Ok):
                held.append(d)
            elif refused is None:
                refused = (refusal(reply, f"{what}: refused", d) if isinstance(reply, ErrorReply)
                           else RunFailed(f"{what}: unexpected answer {type(reply).__name__}", d))
        if refused is not None:
            raise refused
        staggered = dataclasses.replace(request, staggered=spec, micro_batches=len(groups))
        return coordinator.run(plan, staggered, sink=sink, reporter=reporter, helpers={d: hold_id for d in held})
    finally:
        _release(coordinator, held, hold_id)


def _kv_needed(request: RunRequest, plan: ShardPlan):
    """The KV cache a run of ``request`` reaches (its micro-batches, the padded prompt + new tokens)."""
    from core.runs.batching import kv_reservation, run_micro_batches

    groups = run_micro_batches(len(request.input_ids), plan, request.micro_batches)
    return kv_reservation(groups, len(request.input_ids[0]) + request.max_new_tokens)


def _release(coordinator: Coordinator, devices: list[str], hold_id: str) -> None:
    """End the holds the run did not end (a failed start; a lost agent ends its own through the lease)."""
    futs = [(d, coordinator.request_async(d, StopRun(run_id=hold_id))) for d in devices]
    for d, fut in futs:
        try:
            coordinator.link.await_reply(d, fut, 10.0, "ending the attention hold")
        except RunFailed:
            pass


def run_plan(plan, model_dir: str) -> ShardPlan:
    """The ``ShardPlan`` the Run screen runs for an ``OffloadPlan`` on agents named as its devices:
    the dense stage on its first compute device (one replica; the memory agents are the other
    connected agents, ``generate_offload``)."""
    from agents.attention_offload import HeadShape

    shape = HeadShape.of(str(model_dir))
    return dense_plan(Path(model_dir).name, shape.layers, plan.compute[0])


def generate_offload(coordinator: Coordinator, plan: ShardPlan, model_dir: str, prompts, settings, *,
                     sink: RunSink | None = None, reporter: Reporter | None = None):
    """Text in, text out for a dense-stage ``ShardPlan`` (``Technique.run_generation``): the plan's
    one ``attention-offload-dense`` stage is the compute agent, every other connected agent a
    memory agent."""
    from core.runs.generation import generate_with

    if len(plan.stages) != 1 or plan.stages[0].kind != DENSE_KIND:
        raise RunFailed("an attention-offload plan runs as one attention-offload-dense stage (the compute agent); "
                        f"this plan has {len(plan.stages)} stage(s) of kinds "
                        f"{', '.join(sorted({s.kind for s in plan.stages}))}")
    dense = plan.stages[0].device
    memory = [d for d in coordinator.endpoints if d != dense]
    return generate_with(lambda request, s: run_offload(coordinator, model_dir, dense, memory, request, sink=s,
                                                        reporter=reporter, dtype=settings.dtype,
                                                        threads=settings.threads),
                         model_dir, list(prompts), settings, sink=sink)

