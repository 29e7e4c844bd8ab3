"""Expert offloading (EdgeMoE) on agents: a Mixtral stage whose experts live on storage, read into a
bounded buffer (``offload``); what its ``io`` events say (``activity``). It adds a stage kind only:
its stages run in the shared stage run. Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.registry import AgentTechnique

STAGE_KIND = "expert-offload"


def expert_offload_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None,
                            kv=None):
    """A Mixtral stage with its experts on storage, read into a bounded buffer; options from
    ``expert-offload.json`` beside the checkpoint."""
    from agents.techniques.expert_offload.offload import ExpertOffloadExecutor

    return ExpertOffloadExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv)


TECHNIQUE = AgentTechnique(name="expert-offload", executors={STAGE_KIND: expert_offload_executor})
