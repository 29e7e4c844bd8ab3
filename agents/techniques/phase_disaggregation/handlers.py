"""How an agent serves EPD's phase requests: the loaded phase executor answers them, a decode starts
a continuous batch that later requests join between steps; and its stage kinds."""

from __future__ import annotations

from agents.heap import release_free_pages
from agents.protocol import AgentState, ErrorReply
from agents.registry import Handler
from agents.techniques.phase_disaggregation.kinds import COUPLED_KINDS, KINDS
from agents.techniques.phase_disaggregation.messages import PHASE_REQUESTS, DecodeTokens, PrefillPrompt

ROOM = "phase-disaggregation"
"""This technique's state on an agent (``Agent.room``): the loaded stage's ``links`` (its data plane)."""


def _batches(msg) -> bool:
    """A decode request that joins a continuous batch (one copy: profiling's copies run alone)."""
    return isinstance(msg, DecodeTokens) and msg.copies == 1


def close_links(agent) -> None:
    """The loaded stage's data plane goes with the stage."""
    links = agent.room(ROOM).pop("links", None)
    if links is not None:
        links[1].close()


def _links_of(agent, loaded):
    """The stage's ``links.PhaseLinks``, made at its first phase request."""
    state = agent.room(ROOM)
    if state.get("links") is None or state["links"][0] is not loaded:
        from agents.techniques.phase_disaggregation.links import PhaseLinks

        close_links(agent)
        state["links"] = (loaded, PhaseLinks(agent, loaded.msg.peers))
    return state["links"][1]


def serve_phase(agent, msg):
    """The loaded phase executor serves the request; a request it cannot serve (wrong phase, bad
    shapes) is refused by name and the agent stays ready. Compute is slowed like a stage's on an
    emulated device."""
    loaded = agent.loaded_stage
    serve = getattr(loaded.executor, "serve", None) if loaded is not None else None
    if serve is None:
        return ErrorReply(req=msg.req, code="bad_state",
                          message=f"this agent's stage ({loaded.msg.kind if loaded else 'none'}) serves no phase "
                                  f"requests: load an epd-* stage")
    links = _links_of(agent, loaded)
    links.begin(msg.run)  # pieces earlier runs left are stale: dropped
    try:
        check_request_memory(agent, msg)
        return serve(msg, clock=agent.clock, slowdown=agent.emulation.compute_slowdown, links=links)
    except ValueError as err:  # phases.PhaseRequestError, the checkpoint's own checks, the budget's (over_budget)
        return ErrorReply(req=msg.req, code=getattr(err, "code", "failed"), message=f"{msg.type_name()}: {err}")


def kv_bytes_per_token(executor) -> int:
    """Bytes of KV cache one token takes in the text model of ``executor`` (a coupled one: its prefill's; 0: it
    holds none, an encode stage)."""
    text = getattr(executor, "parts", {}).get(PrefillPrompt, executor)
    if not hasattr(text, "kv_heads"):
        return 0
    return text.layers * 2 * text.kv_heads * text.head_dim * text.dtype.itemsize


def check_request_memory(agent, msg, batch=None) -> None:
    """Refuse a prefill or decode whose KV cache would take the agent past its (emulated) memory budget,
    from the model's geometry and the request's tokens, before anything of it is allocated: a prefill's
    prompt; a decode's context and the tokens it may add, for each row of the continuous ``batch`` it
    joins (its cache is padded to the longest row). Beside the loaded stage's weights (``ShardOverBudget``)."""
    if not agent.emulation.memory_budget_bytes or not isinstance(msg, (PrefillPrompt, DecodeTokens)):
        return
    executor = agent.loaded_stage.executor
    weights, per_token = int(executor.memory_bytes()), kv_bytes_per_token(executor)
    if not per_token:  # not this stage's phase: refused by name when served
        return
    mib = 1 << 20
    if isinstance(msg, PrefillPrompt):
        tokens = len(msg.input_ids)
        need = f"request {msg.request}'s prompt of {tokens} tokens needs {tokens * per_token / mib:.1f} MiB of KV cache"
        advice = "prefill it on a device with more memory, or send fewer images or a shorter prompt"
    else:
        # the running rows, and those waiting for their KV cache in this run (an earlier run's never comes)
        others = [] if batch is None else \
            [s.msg for s in batch.running] + [m for m, _ in batch.waiting if m.run == msg.run]
        rows = msg.copies + len(others)
        longest = max(m.kv_shape[3] + m.max_new_tokens if len(m.kv_shape) == 5 else 0 for m in [msg, *others])
        tokens = rows * longest
        need = (f"request {msg.request} needs {tokens * per_token / mib:.1f} MiB of KV cache ({rows} row(s) of its "
                f"batch × {longest} tokens)")
        advice = "use a smaller decode batch, fewer output tokens or a device with more memory"
    agent.emulation.check_need(agent.device, weights + tokens * per_token,
                               f"{need} beside {weights / mib:.1f} MiB of weights", advice)


def serve_phases(agent, msg, stop) -> None:
    """A phase request; a decode starts a continuous batch (``phases.DecodeBatch``): until it is
    empty, decodes that come join it between steps and other phase requests (an aggregated agent's
    encode and prefill) are served between steps too, before the next one (prefill first). Other
    work waits, in order, until the batch is done (``Agent.next_queued``)."""
    from agents.techniques.phase_disaggregation.phases import DecodeBatch

    loaded = agent.loaded_stage
    executor = loaded.executor if loaded is not None else None
    make = getattr(executor, "decode_batch", None)
    batch = make(answer=lambda m, reply: _answer(agent, m, reply), clock=agent.clock,
                 slowdown=agent.emulation.compute_slowdown,
                 links=_links_of(agent, loaded)) if make is not None and _batches(msg) else None
    if not isinstance(batch, DecodeBatch):
        agent.post(serve_phase(agent, msg))
        release_free_pages()  # what the request's activations freed goes back (agents.heap)
        return
    batch.links.begin(msg.run)
    _join(agent, batch, msg)
    while batch:
        while (queued := agent.next_queued(lambda m: isinstance(m, PHASE_REQUESTS))) is not None:
            request, identity = queued
            if _batches(request):
                _join(agent, batch, request, identity)
            else:
                agent.post(serve_phase(agent, request), to=identity)
        batch.step()
    release_free_pages()


def _join(agent, batch, msg, identity=None) -> None:
    """``msg`` joins the decode ``batch``, or is refused over the agent's budget before its KV cache is taken."""
    try:
        check_request_memory(agent, msg, batch)
    except ValueError as err:
        agent.post(ErrorReply(req=msg.req, code=getattr(err, "code", "failed"), message=f"{msg.type_name()}: {err}"),
                   to=identity)
        return
    batch.add(msg)


def _answer(agent, msg, reply) -> None:
    if isinstance(reply, Exception):
        reply = ErrorReply(req=msg.req, code="failed", message=f"{msg.type_name()}: {reply}")
    agent.post(reply)


def admit_phase(agent, msg):
    if agent.state is not AgentState.READY:
        return "bad_state", f"cannot serve {msg.type_name()} while {agent.state}: load an epd-* stage first"
    return None


PHASES_OF = {"encode": ("encode",), "prefill": ("prefill",), "decode": ("decode",),
             "encode_prefill": ("encode", "prefill"), "aggregated": ("encode", "prefill", "decode")}


def planned_phase_bytes(model_dir: str, phases: tuple[str, ...], dtype: str) -> int:
    """Bytes of weights an agent of ``phases`` will hold, from the checkpoint's headers (nothing read):
    the vision tower and projector for encode, the text model (once) for prefill or decode."""
    from agents.checkpoint_reader import CheckpointReader, torch_dtype
    from agents.techniques.phase_disaggregation.phases import PROJECTOR_PREFIXES, VISION_PREFIXES

    reader = CheckpointReader(model_dir)
    encode = tuple(VISION_PREFIXES + PROJECTOR_PREFIXES)
    names = [n for n in reader.names()
             if (n.startswith(encode) and "encode" in phases) or (not n.startswith(encode) and phases != ("encode",))]
    return reader.planned_bytes(names, torch_dtype(dtype))


def _phase_executor(name: str):
    def factory(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None,
                budget=None):
        from agents.techniques.phase_disaggregation import phases

        if budget is not None:  # checked before any tensor is read (agents/shard.py's budget, for a phase)
            budget(planned_phase_bytes(model_dir, PHASES_OF[name], dtype))
        return getattr(phases, f"{name}_executor")(model_dir, start, end, dtype=dtype, threads=threads,
                                                   progress=progress)

    factory.__doc__ = f"EPD (phases): the {name} phase(s) of a Llava checkpoint, served by phase requests."
    return factory


EXECUTORS = {
    **{kind: _phase_executor(phase) for phase, kind in KINDS.items()},
    COUPLED_KINDS[("encode", "prefill")]: _phase_executor("encode_prefill"),
    COUPLED_KINDS[("encode", "prefill", "decode")]: _phase_executor("aggregated"),
}

HANDLERS = tuple(Handler(t, serve=serve_phases, admit=admit_phase) for t in PHASE_REQUESTS)
