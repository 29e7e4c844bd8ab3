"""A real attention-offloading (Lamina) run on agents: the dense side and the memory sides are agents.

The compute device's agent loads the whole model's dense part as stage kind
``attention-offload-dense`` (``Coordinator.load(kind=..., options=...)``: one stage, its
``LoadShard.options``, a ``DenseStage``, name the memory agents and the key/value heads each holds); each memory
agent gets a ``HoldHeads`` (its heads, the dense agent's data address and key) and serves
attention over its KV cache. Per layer, q and the new k, v of each side's heads go from the
dense agent's data socket straight to the memory agents', and the outputs come back the same
way (agents.techniques.attention_offload): nothing per token passes through this process. The coordinator
runs it like any plan (``Coordinator.run``: tokens, the live sink, the run state), so recording,
replay and the timeline take it as they take layer sharding; the memory agents stream their own
attention and send spans into the same run. The run stops the holds after the stage (their last events arrive first); however it ends, they are stopped.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from pathlib import Path
from collections.abc import Sequence

import msgspec

from agents.protocol import ErrorReply, Ok, PeerSpec, StopRun
from agents.techniques.attention_offload.messages import DenseStage, HoldDense, HoldHeads, ServicePeer, StaggeredSpec
from core.devices.agent_link import refusal
from core.errors import HelperLost, MemoryAgentLost, ModelDoesNotFit, RunFailed, ShardOverBudget
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.reporting import Reporter
from core.runs.coordinator import Coordinator, RunRequest, RunResult, RunSink
from agents.techniques.attention_offload.messages import DENSE_KIND
from core.techniques.attention_offload.problem import OffloadModel

HOLD_TIMEOUT_S = 120.0
MIB = 1 << 20


def head_ranges(kv_heads: int, memory: int) -> list[tuple[int, int]]:
    """Key/value heads over ``memory`` agents, balanced by heads (``agents.techniques.attention_offload.split_heads``)."""
    from agents.techniques.attention_offload.heads import split_heads

    return [(r.start, r.stop) for r in split_heads(kv_heads, memory)]


LLAMA_LIKE_KEYS = ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
"""What a Llama-like config.json must name for its geometry to be read without transformers."""


def _config_fields(model_dir: str):
    """The checkpoint's config as attributes: a Llama-like config.json read as JSON (the studio picking
    attention offloading imported torch and transformers in its GUI thread for AutoConfig: 3-4 s frozen
    at load 10, 14.6 s at load 17); any other (GPT-2's names, a missing key, no file) through
    ``load_config``, which maps the names or says what is wrong."""
    import json
    from types import SimpleNamespace

    from core.models.units import SUPPORTED_FAMILIES  # the checkpoint reader's families (it imports torch)

    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        data = None
    if (isinstance(data, dict) and data.get("model_type") in SUPPORTED_FAMILIES and data.get("model_type") != "gpt2"
            and all(isinstance(data.get(k), int) and data[k] > 0 for k in LLAMA_LIKE_KEYS)):
        return SimpleNamespace(**data)
    from agents.checkpoint_reader import load_config

    return load_config(model_dir)


def checkpoint_model(model_dir: str, bytes_per_element: int = 4) -> OffloadModel:
    """The cost model's view of a checkpoint (what a run on it is predicted with)."""
    config = _config_fields(model_dir)
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
    memory = list(memory_devices)
    if not memory:
        raise RunFailed("attention offloading needs at least one memory agent")
    if dense_device in memory or len(set(memory)) != len(memory):
        raise RunFailed("the compute agent and the memory agents must be different devices, each once")
    from agents.checkpoint_reader import CheckpointError

    try:
        shape = checkpoint_model(model_dir)  # config.json read as JSON: no transformers import
        ranges = head_ranges(shape.kv_heads, len(memory))
    except CheckpointError as err:
        raise RunFailed(str(err)) from None
    plan = dense_plan(Path(model_dir).name, shape.layers, dense_device)
    kv = _kv_needed(request, plan)
    statuses = coordinator.status_of([dense_device, *memory])
    services = tuple(ServicePeer(device=d, data_address=statuses[d].data_address,
                                 public_key=statuses[d].public_key, start=a, stop=b)
                     for d, (a, b) in zip(memory, ranges))
    _load_dense(coordinator, plan, str(model_dir), dtype, threads, {dense_device: services}, reporter)
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
        return _run_naming_lost_memory(coordinator, plan, request, sink, reporter, held, hold_id,
                                       dict(zip(memory, ranges)), [dense_device])
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
    from agents.checkpoint_reader import CheckpointError
    from agents.techniques.attention_offload.schedule import STAGGERED_SCHEDULES
    from core.runs.batching import run_micro_batches

    compute, memory = list(compute_devices), list(memory_devices)
    if schedule not in STAGGERED_SCHEDULES:
        raise RunFailed(f"unknown staggered schedule {schedule!r}: one of {', '.join(STAGGERED_SCHEDULES)}")
    if not compute or not memory:
        raise RunFailed("staggered attention offloading needs at least one compute and one memory agent")
    if len(set(compute + memory)) != len(compute) + len(memory):
        raise RunFailed("the compute agents and the memory agents must be different devices, each once")
    try:
        shape = checkpoint_model(model_dir)  # config.json read as JSON: no transformers import
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
    _load_dense(coordinator, plan, str(model_dir), dtype, threads, {compute[0]: services}, reporter)
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
        staggered = dataclasses.replace(request, options=spec, micro_batches=len(groups))
        return _run_naming_lost_memory(coordinator, plan, staggered, sink, reporter, held, hold_id,
                                       dict(zip(memory, ranges)), compute)
    finally:
        _release(coordinator, held, hold_id)


def _load_dense(coordinator: Coordinator, plan: ShardPlan, model_dir: str, dtype: str, threads: int,
                services: dict, reporter) -> None:
    """Load the dense stage; an agent whose budget cannot hold it is refused with attention
    offloading's advice (the agent's own says "plan fewer units on it", which does not apply:
    the compute agent holds every layer)."""
    try:
        coordinator.load(plan, model_dir, dtype=dtype, threads=threads, kind=DENSE_KIND,
                         options={d: DenseStage(services=s) for d, s in services.items()}, reporter=reporter)
    except ShardOverBudget as err:
        need = dense_weight_bytes(model_dir, dtype)
        fact = err.reason.split(": plan fewer units")[0]
        raise ShardOverBudget(
            f"{fact}. It cannot be attention offloading's compute agent, which holds every layer's dense weights "
            f"({need / MIB:.1f} MiB; the KV cache is on the memory agents): make an agent with a memory budget of "
            f"at least {_mib_up(need)} MiB the compute agent (the Plan screen's Run on agents picks one from the "
            f"profiled budgets; a plan file names it as its first compute device), give {err.device} that much "
            "memory, or run a smaller model", err.device) from None


def dense_weight_bytes(model_dir: str, dtype: str = "float32") -> int:
    """Bytes of the weights a compute agent holds: the whole model's (embedding, every block, head)."""
    from core.models.units import load_model_spec

    return load_model_spec(model_dir, dtype={"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
                           ).param_bytes


def _mib_up(nbytes: int) -> str:
    """``nbytes`` in MiB rounded up to a tenth (a budget of that many MiB holds it)."""
    return f"{-(-nbytes * 10 // MIB) / 10:.1f}"


def choose_compute(agents: Sequence[str], budgets: dict[str, int], dense_bytes: int,
                   wanted: int) -> tuple[str, int]:
    """(the compute agent, how many compute replicas) for a run on ``agents`` (in order): the first
    agent whose memory budget holds the dense part (``budgets``: profiled, in bytes; an agent
    without one decides for itself at load), and up to ``wanted`` replicas as long as every one
    ``agent_roles`` picks holds it too, leaving a memory agent. ``ModelDoesNotFit`` when no agent
    can: it names each agent's budget and how much one needs."""
    def holds(agent: str) -> bool:
        return budgets.get(agent, 0) <= 0 or budgets[agent] >= dense_bytes

    fitting = [a for a in agents if holds(a)]
    if not fitting:
        have = ", ".join(f"{a} {budgets[a] / MIB:.1f} MiB" for a in sorted(agents, key=lambda a: -budgets[a]))
        raise ModelDoesNotFit(
            f"no connected agent can be attention offloading's compute agent: it holds every layer's dense weights, "
            f"{dense_bytes / MIB:.1f} MiB (the KV cache is on the memory agents), and the agents' memory budgets are "
            f"{have}. Give one agent a budget of at least {_mib_up(dense_bytes)} MiB (a device with more memory, or an "
            f"emulated agent: edgeshard cluster local --memory-mib, agents serve --memory-budget-mib "
            f"{_mib_up(dense_bytes)} or more), or run a smaller model", dense_bytes - max(budgets[a] for a in agents))
    dense = fitting[0]
    replicas = max(1, min(wanted, len(agents) - 1))
    while replicas > 1 and not all(holds(a) for a in agent_roles(dense, agents, replicas)[0]):
        replicas -= 1
    return dense, replicas


def _run_naming_lost_memory(coordinator: Coordinator, plan: ShardPlan, request: RunRequest, sink, reporter,
                            held: list[str], hold_id: str, memory: dict[str, tuple[int, int]],
                            compute: Sequence[str]) -> RunResult:
    """``coordinator.run`` with the holds as helpers; a memory agent lost mid-run (its heartbeats
    stopped, or a dense agent saw its data connection drop) ends it with ``MemoryAgentLost``
    naming it. The lost agent is taken out of ``held``: its hold ended with it (nothing to wait for)."""
    try:
        return coordinator.run(plan, request, sink=sink, reporter=reporter, helpers={d: hold_id for d in held})
    except RunFailed as err:
        lost = lost_memory_agents(err, list(memory))
        if not lost:
            raise
        for d in lost:
            if d in held:
                held.remove(d)
        others = [d for d in [*compute, *memory] if d not in lost]
        heads = "; ".join(f"{d}: key/value heads [{memory[d][0]}, {memory[d][1]})" for d in lost)
        raise MemoryAgentLost(
            f"memory agent {', '.join(lost)} was lost mid-run ({heads}; {err.reason}). The KV cache it held is "
            f"gone, so the run cannot go on: restart its agent (the Devices screen, or edgeshard deploy) or run on "
            f"the other memory agents. {', '.join(others)} ended the run and are free for the next one.",
            lost[0]) from None


def lost_memory_agents(err: RunFailed, memory: Sequence[str]) -> list[str]:
    """The memory agents a failed run lost: a lost helper named by the coordinator (``HelperLost``),
    or the ones a dense agent's ``MemorySideSilent`` names (``memory agent <names> ...``)."""
    if isinstance(err, HelperLost):
        return [err.device] if err.device in memory else []
    match = re.search(r"MemorySideSilent: memory agent ((?:[^\s,]+, )*[^\s,]+) ", err.reason)
    if match is None:
        return []
    return [d for d in match.group(1).split(", ") if d in memory]


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
    the dense stage on its first compute device (replica 0; the other replicas and the memory agents
    are the other connected agents, ``agent_roles``)."""
    shape = checkpoint_model(str(model_dir))
    return dense_plan(Path(model_dir).name, shape.layers, plan.compute[0])


@dataclasses.dataclass(frozen=True)
class OffloadRunOptions:
    """How the Run screen runs a dense-stage plan: ``compute_replicas`` compute agents (staggered
    pipelining when more than one, or when micro-batches are asked for) with ``schedule``."""

    compute_replicas: int = 1
    schedule: str = "rotational"
    compute: tuple[str, ...] = ()
    """The compute replicas by name, replica 0 first (a plan of the measured cluster names them);
    empty: the plan's dense device and the next connected agents (``agent_roles``)."""
    memory: tuple[str, ...] = ()
    """The memory agents by name, with ``compute``; empty: every other connected agent."""

    @classmethod
    def of(cls, options) -> "OffloadRunOptions":
        """From the Run screen's recorded options (a mapping; names it does not know are refused)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise RunFailed(f"attention offloading has no run option {', '.join(unknown)} "
                            f"(it knows {', '.join(sorted(known))})")
        replicas, schedule = options.get("compute_replicas", 1), options.get("schedule", "rotational")
        if type(replicas) is not int or not isinstance(schedule, str):
            raise RunFailed(f"compute_replicas must be an integer and schedule a name; got {replicas!r}, {schedule!r}")
        compute, memory = options.get("compute") or (), options.get("memory") or ()
        if not all(isinstance(d, str) for d in (*compute, *memory)) or (compute and len(compute) != replicas):
            raise RunFailed(f"compute must name compute_replicas ({replicas}) agents and memory agents by name; got "
                            f"{compute!r}, {memory!r}")
        return cls(compute_replicas=replicas, schedule=schedule, compute=tuple(compute), memory=tuple(memory))


HISTORY_SAMPLING_REFUSED = ("staggered attention offloading (several compute replicas, or micro-batches) samples "
                            "without a token history: no repetition penalty or n-gram ban; run one compute replica "
                            "with the plan's micro-batches to use them")
"""Why a staggered run has no repetition penalty or n-gram ban (agents.techniques.attention_offload.staggered refuses them)."""


def is_staggered(options: OffloadRunOptions, micro_batches: int | None) -> bool:
    """Whether a run with ``options`` and the Run screen's ``micro_batches`` override (None: the
    plan's) runs Lamina's staggered pipelining (``run_staggered``) rather than one replica."""
    return options.compute_replicas > 1 or micro_batches is not None


def agent_roles(dense_device: str, agents: Sequence[str], replicas: int) -> tuple[list[str], list[str]]:
    """(compute, memory): the plan's dense device is replica 0, the next ``replicas - 1`` connected
    agents the other replicas, every other agent a memory agent. ``RunFailed`` says what to change
    when no memory agent would be left."""
    others = [d for d in agents if d != dense_device]
    if replicas < 1:
        raise RunFailed(f"compute replicas must be 1 or more, got {replicas}")
    if replicas > len(others):
        raise RunFailed(f"{replicas} compute replica(s) over {len(others) + 1} agents leave no memory agent: "
                        f"use at most {len(others)} compute replica(s), or connect more agents")
    return [dense_device, *others[:replicas - 1]], others[replicas - 1:]


def named_roles(options: OffloadRunOptions, dense_device: str, agents: Sequence[str]) -> tuple[list[str], list[str]]:
    """(compute, memory) for a run: the ones ``options`` names (each a connected agent, replica 0 the
    plan's dense device, no agent twice), else ``agent_roles``. ``RunFailed`` says which name is wrong."""
    if not options.compute:
        return agent_roles(dense_device, agents, options.compute_replicas)
    compute = list(options.compute)
    memory = list(options.memory) or [d for d in agents if d not in compute]
    unknown = [d for d in compute + memory if d not in agents]
    if unknown or compute[0] != dense_device or len(set(compute + memory)) != len(compute + memory) or not memory:
        raise RunFailed(f"the run names compute {', '.join(compute)} and memory {', '.join(memory) or 'none'}: each "
                        f"must be a connected agent ({', '.join(agents)}), used once, with at least one memory agent "
                        f"and the plan's dense device {dense_device} as replica 0; re-plan (Run on agents) and start again")
    return compute, memory


def lane_roles(dense_device: str, agents: Sequence[str], replicas: int | OffloadRunOptions) -> dict[str, str]:
    """Device -> its role in a run (``compute`` / ``compute <i>``, ``attention``) as ``named_roles``
    (or, for a replica count, ``agent_roles``) splits them; {} when it cannot (the run itself then
    says why). The timeline's lane notes."""
    options = replicas if isinstance(replicas, OffloadRunOptions) else OffloadRunOptions(compute_replicas=replicas)
    try:
        compute, memory = named_roles(options, dense_device, agents)
    except RunFailed:
        return {}
    notes = {d: f"compute {i}" if len(compute) > 1 else "compute" for i, d in enumerate(compute)}
    return {**notes, **{d: "attention" for d in memory}}


def generate_offload(coordinator: Coordinator, plan: ShardPlan, model_dir: str, prompts, settings, *,
                     sink: RunSink | None = None, reporter: Reporter | None = None,
                     options: OffloadRunOptions = OffloadRunOptions()):
    """Text in, text out for a dense-stage ``ShardPlan`` (``Technique.run_generation``): the plan's
    one ``attention-offload-dense`` stage is compute replica 0, ``options`` says how many replicas
    and which staggering; the other connected agents are the memory agents (``agent_roles``)."""
    from agents.techniques.attention_offload.schedule import STAGGERED_SCHEDULES
    from core.runs.generation import generate_with

    if len(plan.stages) != 1 or plan.stages[0].kind != DENSE_KIND:
        raise RunFailed("an attention-offload plan runs as one attention-offload-dense stage (the compute agent); "
                        f"this plan has {len(plan.stages)} stage(s) of kinds "
                        f"{', '.join(sorted({s.kind for s in plan.stages}))}")
    if options.schedule not in STAGGERED_SCHEDULES:
        raise RunFailed(f"unknown staggered schedule {options.schedule!r}: one of {', '.join(STAGGERED_SCHEDULES)}")
    compute, memory = named_roles(options, plan.stages[0].device, list(coordinator.endpoints))
    staggered = is_staggered(options, settings.micro_batches)
    if staggered and settings.micro_batches is None:
        settings = dataclasses.replace(settings, micro_batches=len(compute) + 1)  # Lamina's n = replicas + 1

    def run(request, s):
        if staggered:
            return run_staggered(coordinator, model_dir, compute, memory, request, schedule=options.schedule, sink=s,
                                 reporter=reporter, dtype=settings.dtype, threads=settings.threads)
        return run_offload(coordinator, model_dir, compute[0], memory, request, sink=s, reporter=reporter,
                           dtype=settings.dtype, threads=settings.threads)

    return generate_with(run, model_dir, list(prompts), settings, sink=sink)
