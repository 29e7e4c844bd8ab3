"""Encode / prefill / decode disaggregation (EPD) on agents: a Llava checkpoint split by phase.

``phases``: one executor per phase and the continuous decode batch; ``links``: the multimodal
tokens and KV caches the phases push to each other; ``kinds``: the stage kinds (no torch);
``messages``: its wire; ``handlers``: how an agent serves it. Registered as ``TECHNIQUE`` by
``agents.techniques``."""

from __future__ import annotations

from agents.registry import AgentTechnique, DataKind
from agents.techniques.phase_disaggregation import handlers
from agents.techniques.phase_disaggregation.messages import DATA_KINDS, PHASE_MESSAGES

TECHNIQUE = AgentTechnique(
    name="phase-disaggregation",
    messages=PHASE_MESSAGES,
    data_kinds=tuple(DataKind(kind) for kind in DATA_KINDS),
    handlers=handlers.HANDLERS,
    executors=handlers.EXECUTORS,
    on_unload=handlers.close_links,
)
