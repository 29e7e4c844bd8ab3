"""Expert offloading (EdgeMoE) on agents: a Mixtral stage whose experts live on storage, read into a
bounded buffer (``offload``); what its ``io`` events say (``activity``). It adds a stage kind only:
its stages run in the shared stage run, their settings in the load message (``options``). Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.heap import return_freed_memory_to_the_os
from agents.registry import AgentTechnique
from agents.techniques.expert_offload.options import OffloadOptions

STAGE_KIND = "expert-offload"


def expert_offload_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None,
                            kv=None, options=None, budget=None):
    """A Mixtral stage with its experts on storage, read into a bounded buffer; its settings and the
    hashes of the files it reads come in the load message (``OffloadOptions``), never from a file."""
    from agents.techniques.expert_offload.offload import ExpertOffloadExecutor

    if not isinstance(options, OffloadOptions):
        raise ValueError("an expert-offload stage's settings travel in its load message and none came: make its "
                         "plan with `edgeshard moe configure PLAN MODEL_DIR --run-plan RUN.json`")
    return_freed_memory_to_the_os()  # an evicted expert's MiBs go back to the OS (agents.heap)
    return ExpertOffloadExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv,
                                 options=options, budget=budget)


TECHNIQUE = AgentTechnique(name="expert-offload", options=(OffloadOptions,),
                           executors={STAGE_KIND: expert_offload_executor})
