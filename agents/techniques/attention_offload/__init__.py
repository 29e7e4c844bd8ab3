"""Attention offloading (Lamina) on agents: the model split at the attention operator.

``heads``: the split itself (dense side without KV, attention stores by key/value heads);
``data_plane``: the dense agent's router and stage executor and the memory agent's service;
``staggered`` and ``schedule``: staggered pipelining over several compute replicas; ``messages``:
its wire; ``handlers``: how an agent serves it. Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.registry import AgentTechnique, DataKind
from agents.techniques.attention_offload import handlers
from agents.techniques.attention_offload.messages import (
    DENSE_KIND,
    AttendHeads,
    AttendSpec,
    DenseStage,
    HeadsAttended,
    HoldDense,
    HoldHeads,
    StaggeredSpec,
)

TECHNIQUE = AgentTechnique(
    name="attention-offload",
    messages=(AttendHeads, HoldHeads, HoldDense, HeadsAttended),
    options=(DenseStage, StaggeredSpec, AttendSpec),
    data_kinds=(DataKind("attend", AttendSpec), DataKind("attended", AttendSpec), DataKind("residual", AttendSpec),
                DataKind("start")),
    handlers=handlers.HANDLERS,
    executors={DENSE_KIND: handlers.dense_executor},
    run_drivers={StaggeredSpec: handlers.staggered_run},
)
