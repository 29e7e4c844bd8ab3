"""Expert offloading (EdgeMoE) on agents: a Mixtral stage whose experts live on storage, read into a
bounded buffer (``offload``); what its ``io`` events say (``activity``). It adds a stage kind only:
its stages run in the shared stage run, their settings in the load message (``options``). Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

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
    return_evicted_experts_to_the_os()
    return ExpertOffloadExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv,
                                 options=options, budget=budget)


EXPERT_MMAP_THRESHOLD = 1 << 20


def return_evicted_experts_to_the_os() -> None:
    """Fix glibc's mmap threshold at 1 MiB in this process, so an expert evicted from the buffer (MiBs
    each) goes back to the OS when freed. glibc otherwise raises the threshold to the size of the
    first big block freed, and later experts come from its heap, which keeps what they freed: an
    agent holding 6 slots of 8.25 MiB (61.6 MiB planned) grew 108 MiB, the buffer's churn kept in the
    heap (measured, bench/memory_fidelity.py). Smaller allocations (a decode's activations) are
    unaffected. A no-op where glibc's ``mallopt`` is not there."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, EXPERT_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


TECHNIQUE = AgentTechnique(name="expert-offload", options=(OffloadOptions,),
                           executors={STAGE_KIND: expert_offload_executor})
