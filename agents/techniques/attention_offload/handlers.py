"""How an agent serves attention offloading's messages: heads attended on request (``AttendHeads``),
a memory agent's hold on the data plane (``HoldHeads``), a staggered run's compute replica
(``HoldDense``), and its dense stage kind and staggered run driver."""

from __future__ import annotations

from agents.emulation import compute_began, end_emulated
from agents.protocol import AgentState, ErrorReply, Ok
from agents.registry import Handler
from agents.techniques.attention_offload.messages import AttendHeads, HeadsAttended, HoldDense, HoldHeads

ROOM = "attention-offload"
"""This technique's state on an agent (``Agent.room``): the ``stores`` serving ``AttendHeads``."""


def attend_heads(agent, msg: AttendHeads, stop):
    """The memory side on request (``heads.AttentionStore``): one store per (model geometry, heads),
    kept across requests; bad tensors get an ErrorReply."""
    from agents.model_code import MODEL_CODE_IMPORTED
    from agents.techniques.attention_offload import heads

    stores = agent.room(ROOM).setdefault("stores", {})
    key = (msg.model_dir, msg.kv_start, msg.kv_stop)
    store = stores.get(key)
    if msg.drop:
        if store is not None:
            store.drop(msg.group, msg.drop_layers or None)
        return Ok(req=msg.req, detail="dropped")
    MODEL_CODE_IMPORTED.wait()  # transformers' lazy modules: never import alongside the warm-up thread
    t_start = agent.clock()
    began = compute_began()
    try:
        if store is None:
            shape = heads.HeadShape.of(msg.model_dir)
            store = heads.AttentionStore(shape, range(msg.kv_start, msg.kv_stop),
                                         budget_bytes=agent.emulation.memory_budget_bytes)
            stores[key] = store
        out = heads.attend_frames(store, msg)
    except Exception as err:  # a bad request: named to the coordinator, the agent stays up
        return ErrorReply(req=msg.req, code="failed", message=f"attention: {type(err).__name__}: {err}")
    end_emulated(agent.emulation.compute_slowdown, began)
    return HeadsAttended(req=msg.req, shape=tuple(out.shape), data=out.numpy().tobytes(), t_start=t_start,
                         t_end=agent.clock())


def admit_attend(agent, msg: AttendHeads):
    if agent.state is AgentState.LOADING:
        return "bad_state", f"cannot attend while {agent.state}"
    return None


def hold_heads(agent, msg: HoldHeads, stop) -> None:
    """The memory side on the data plane (``data_plane.HeadsService``), served until the hold's
    StopRun (or its lease) ends it."""
    agent.free_memory()  # what other techniques keep goes to the hold
    from agents.model_code import MODEL_CODE_IMPORTED
    from agents.techniques.attention_offload.data_plane import HeadsService

    MODEL_CODE_IMPORTED.wait()

    def open_service():
        service = HeadsService(agent, msg, stop)
        agent.log(f"holding heads [{msg.kv_start}, {msg.kv_stop}) of {msg.model_dir} for "
                  f"{', '.join(p.device for p in msg.dense)}")
        return service

    agent.serve_held(msg, "attention hold", open_service, ready=f"holding heads [{msg.kv_start}, {msg.kv_stop})",
                     ended="ended")


def hold_dense(agent, msg: HoldDense, stop) -> None:
    """A compute replica of the staggered pipelining (``staggered.HeldReplica``), served until the
    hold's StopRun."""
    agent.free_memory()  # what other techniques keep goes to the hold
    from agents.model_code import MODEL_CODE_IMPORTED
    from agents.techniques.attention_offload.staggered import HeldReplica

    MODEL_CODE_IMPORTED.wait()

    def open_service():
        service = HeldReplica(agent, msg, stop)
        agent.log(f"holding the dense part of {msg.model_dir} as replica {msg.replica} "
                  f"({msg.staggered.schedule} staggering)")
        return service

    agent.serve_held(msg, "dense replica hold", open_service, ready=f"replica {msg.replica} loaded", ended="ended")


def dense_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None,
                   agent=None, options=None):
    """Lamina: the dense part of units [start, end), its attention on the memory agents its
    ``LoadShard.options`` (a ``DenseStage``) names, reached over this agent's data plane."""
    from agents.techniques.attention_offload.data_plane import DenseAgentExecutor

    services = options.services if options is not None else ()
    return DenseAgentExecutor(model_dir, start, end, agent=agent, services=services, dtype=dtype, threads=threads,
                              progress=progress)


def staggered_run(agent, loaded, msg, stop):
    """A ``StartRun`` whose options are a ``StaggeredSpec`` (the source replica): its own schedule."""
    from agents.techniques.attention_offload.staggered import run_source

    return run_source(agent, loaded, msg, stop)


HANDLERS = (
    Handler(AttendHeads, serve=attend_heads, admit=admit_attend),
    Handler(HoldHeads, serve=hold_heads, takes_run=True, exclusive=True, replaces_stage=True,
            wanted="hold attention heads",
            describe=lambda agent, m: f"attention-offload hold {m.run_id} (KV heads [{m.kv_start}, {m.kv_stop}))"),
    Handler(HoldDense, serve=hold_dense, takes_run=True, exclusive=True, replaces_stage=True,
            wanted="hold a dense replica",
            describe=lambda agent, m: f"attention-offload dense replica hold {m.run_id} (replica {m.replica})"),
)
