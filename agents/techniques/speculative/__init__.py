"""Speculative decoding across the layer-sharding stages, greedy and exact.

The source drafts ``k`` tokens with a small model sharing the target's tokenizer; the stages verify
them in one trip (each rewinds its KV cache to the committed length first) and the target's own
greedy tokens decide what is kept (the draft on another stage: ``remote_draft``). ``messages``: its wire; ``session``: the run (a stage's verify is
``agents.shard.StageExecutor.decode_positions``: a rewind, then several positions at once). Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.registry import AgentTechnique, DataKind, Handler
from agents.techniques.speculative.messages import (
    DRAFT_ASK,
    PROPOSALS,
    VERDICT,
    VERIFY,
    ReadStageCache,
    SpeculativeOptions,
    StageCache,
    DraftAsk,
    DraftTimed,
    TimeDraft,
    VerifyFrame,
)


def drive(agent, loaded, msg, stop):
    from agents.techniques.speculative.session import drive as run

    return run(agent, loaded, msg, stop)


def read_cache(agent, identity, msg: ReadStageCache):
    """The kept KV cache, on the control thread (it is not changed once kept), to its stage's own
    coordinator only: another coordinator must not read what this one's run computed."""
    if not agent.owns(identity):
        return "not_owner", f"{agent.device}'s KV cache is read only by the coordinator whose stage it is"
    from agents.techniques.speculative.session import ROOM

    kept = agent.room(ROOM).get("kept_cache")
    if kept is None:
        return "no_cache", f"{agent.device} kept no KV cache: run speculatively with keep_cache first"
    length, layers = kept
    agent.post(StageCache(req=msg.req, length=length, layers=tuple(i for i, _, _ in layers),
                          shape=tuple(layers[0][1].shape) if layers else (1, 0, length, 0),
                          dtype=str(layers[0][1].dtype).removeprefix("torch.") if layers else "float32",
                          keys=tuple(_raw(k) for _, k, _ in layers),
                          values=tuple(_raw(v) for _, _, v in layers)), to=identity)
    return None


def _raw(t) -> bytes:
    """A tensor's bytes whatever its dtype (numpy has no bfloat16: viewed as bytes first)."""
    import torch

    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def time_draft(agent, msg: TimeDraft, stop):
    from agents.techniques.speculative.timing import time_draft as timed

    return timed(agent, msg, stop)


def forget_cache(agent) -> None:
    from agents.techniques.speculative.session import ROOM

    agent.room(ROOM).pop("kept_cache", None)


TECHNIQUE = AgentTechnique(
    name="speculative",
    messages=(ReadStageCache, StageCache, TimeDraft, DraftTimed),
    options=(SpeculativeOptions, VerifyFrame, DraftAsk),
    data_kinds=(DataKind(VERIFY, VerifyFrame), DataKind(VERDICT, None, required=False), DataKind(DRAFT_ASK, DraftAsk),
                DataKind(PROPOSALS, None, required=False)),
    handlers=(Handler(ReadStageCache, on_control=read_cache),
              Handler(TimeDraft, serve=time_draft, exclusive=True, wanted="time a draft", activity="timing a draft")),
    run_drivers={SpeculativeOptions: drive},
    free_memory=forget_cache,
    on_unload=forget_cache,
)
