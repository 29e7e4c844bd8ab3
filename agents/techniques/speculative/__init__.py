"""Speculative decoding across the layer-sharding stages, greedy and exact.

The source drafts ``k`` tokens with a small model sharing the target's tokenizer; the stages verify
them in one trip (each rewinds its KV cache to the committed length first) and the target's own
greedy tokens decide what is kept. ``messages``: its wire; ``session``: the run (a stage's verify is
``agents.shard.StageExecutor.decode_positions``: a rewind, then several positions at once). Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.registry import AgentTechnique, DataKind
from agents.techniques.speculative.messages import VERDICT, VERIFY, SpeculativeOptions, VerifyFrame


def drive(agent, loaded, msg, stop):
    from agents.techniques.speculative.session import drive as run

    return run(agent, loaded, msg, stop)


TECHNIQUE = AgentTechnique(
    name="speculative",
    options=(SpeculativeOptions, VerifyFrame),
    data_kinds=(DataKind(VERIFY, VerifyFrame), DataKind(VERDICT, None, required=False)),
    run_drivers={SpeculativeOptions: drive},
)
