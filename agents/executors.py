"""Stage executors by stage kind: how an agent runs the part of the model its stage holds.

The agent side of the technique seam (core/techniques): each technique registers the
executor of its stage kind here, ``LoadShard.kind`` names the kind, and the agent builds
that executor. The stage loop only needs the ``StageExecutorLike`` surface, so a new
technique does not edit the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class StageExecutorLike(Protocol):
    """What the stage loop calls (agents.shard.StageExecutor is the layer-sharding one)."""

    is_first: bool
    is_last: bool

    def prefill(self, group: int, x: Any, attention_mask: Any) -> Any: ...

    def decode(self, group: int, x: Any) -> Any: ...

    def drop(self, group: int) -> None: ...

    def memory_bytes(self) -> int: ...


ExecutorFactory = Callable[..., StageExecutorLike]
"""``factory(model_dir, start, end, *, dtype, threads, progress=None)``."""

_EXECUTORS: dict[str, ExecutorFactory] = {}


class UnknownStageKind(ValueError):
    """A LoadShard asks for a stage kind this agent has no executor for (an older agent?)."""


def register_executor(kind: str, factory: ExecutorFactory) -> None:
    """Make ``kind`` loadable on this agent (a technique's agent module calls this at import)."""
    if _EXECUTORS.get(kind, factory) is not factory:
        raise ValueError(f"stage kind {kind!r} already has an executor")
    _EXECUTORS[kind] = factory


def unregister_executor(kind: str) -> None:
    _EXECUTORS.pop(kind, None)


def executor_factory_for(kind: str) -> ExecutorFactory:
    """The factory of ``kind``, or ``UnknownStageKind`` naming the kinds this agent runs."""
    try:
        return _EXECUTORS[kind]
    except KeyError:
        known = ", ".join(sorted(_EXECUTORS)) or "none"
        raise UnknownStageKind(
            f"this agent has no executor for stage kind {kind!r} (it runs: {known}); "
            "upgrade the agent to the studio's version"
        ) from None


def layers_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None, kv=None):
    """Layer sharding: units [start, end) of an HF decoder checkpoint (agents.shard), its KV
    cache allocated at load when ``kv`` (a ``KvReservation``) asks for it."""
    from agents.shard import StageExecutor  # torch/transformers load lazily: the agent starts fast

    return StageExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv)


register_executor("layers", layers_executor)


def expert_offload_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None,
                            kv=None):
    """EdgeMoE (agents.expert_offload): a Mixtral stage with its experts on storage, read into a
    bounded buffer; options from ``expert-offload.json`` beside the checkpoint."""
    from agents.expert_offload import ExpertOffloadExecutor

    return ExpertOffloadExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv)


register_executor("expert-offload", expert_offload_executor)


def attention_offload_dense_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None,
                                     progress=None, agent=None, services=()):
    """Lamina (agents.attention_offload): the dense part of units [start, end), its attention on the
    memory agents ``services`` (LoadShard.services), reached over this agent's data plane."""
    from agents.attention_offload import DenseAgentExecutor

    return DenseAgentExecutor(model_dir, start, end, agent=agent, services=services, dtype=dtype, threads=threads,
                              progress=progress)


register_executor("attention-offload-dense", attention_offload_dense_executor)


def _phase(name: str):
    def factory(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None):
        from agents import phases

        return getattr(phases, f"{name}_executor")(model_dir, start, end, dtype=dtype, threads=threads,
                                                   progress=progress)

    factory.__doc__ = f"EPD (agents.phases): the {name} phase(s) of a Llava checkpoint, served by phase requests."
    return factory


for _name in ("encode", "prefill", "decode"):
    register_executor(f"epd-{_name}", _phase(_name))
register_executor("epd-encode-prefill", _phase("encode_prefill"))
register_executor("epd-aggregated", _phase("aggregated"))
