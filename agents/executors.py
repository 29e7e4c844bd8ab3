"""Stage executors by stage kind: how an agent runs the part of the model its stage holds.

``LoadShard.kind`` names the kind and the agent builds that executor. ``layers`` (layer
sharding, agents.shard) is the shared default stage: the stage run, ``LoadShard`` and
``StartRun`` are its protocol, and every other stage kind runs inside that same stage run. Every
other kind is a technique's, registered with its room (``agents.registry.AgentTechnique.executors``).
The stage run only needs the ``StageExecutorLike`` surface, so a new technique does not edit the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from agents import registry


class StageExecutorLike(Protocol):
    """What the stage run calls (agents.shard.StageExecutor is the layer-sharding one).

    Optional, read with ``getattr``: ``take_events()`` (an executor's own timeline events),
    ``records_own_spans`` (it records its compute spans itself), ``slows_itself`` (it applies the
    emulated slowdown to its own compute, not its waits), ``kv_reserved_bytes``, ``huge_page_bytes``,
    ``close()`` (sockets of its own). A factory that takes ``options`` gets the stage's decoded
    ``LoadShard.options``, one that takes ``agent`` the agent (its data plane and clock), one that
    takes ``weights`` the stage's weight precision (``LoadShard.weights``; a factory without it runs
    only ``fp``)."""

    is_first: bool
    is_last: bool

    def prefill(self, group: int, x: Any, attention_mask: Any) -> Any: ...

    def decode(self, group: int, x: Any) -> Any: ...

    def drop(self, group: int) -> None: ...

    def memory_bytes(self) -> int: ...


ExecutorFactory = Callable[..., StageExecutorLike]
"""``factory(model_dir, start, end, *, dtype, threads, progress=None[, kv][, options][, agent])``."""


class UnknownStageKind(ValueError):
    """A LoadShard asks for a stage kind this agent has no executor for (an older agent?)."""


def layers_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None, kv=None,
                    weights: str = "fp", budget=None, torch_device: str = "cpu", accelerators=None):
    """Layer sharding: units [start, end) of an HF decoder checkpoint (agents.shard), its KV
    cache allocated at load when ``kv`` (a ``KvReservation``) asks for it, its blocks' weights at
    ``weights`` precision (agents.weight_precision), computed on ``torch_device`` (one of the agent's
    ``accelerators`` where it names a GPU)."""
    from agents.shard import StageExecutor  # torch/transformers load lazily: the agent starts fast

    return StageExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress, kv=kv,
                         weights=weights, budget=budget, torch_device=torch_device, accelerators=accelerators)


def placement(params, msg, accelerators=None) -> dict:
    """The weight precision and torch device a ``LoadShard`` asks for, as keywords of an executor factory
    whose parameters are ``params`` (and the agent's ``accelerators`` for a GPU stage); a kind that takes
    neither is refused anything but fp on the CPU."""
    kwargs = {}
    if "accelerators" in params and accelerators is not None and msg.torch_device != "cpu":
        kwargs["accelerators"] = accelerators
    for name, default, words in (("weights", "fp", "fp weights"), ("torch_device", "cpu", "the CPU")):
        value = getattr(msg, name)
        if name in params:
            kwargs[name] = value
        elif value != default:
            raise ValueError(f"stage kind {msg.kind!r} runs on {words} only, this plan asks for {value}: "
                             f"give that stage {default}")
    return kwargs


DEFAULT_KIND = "layers"


def executor_factory_for(kind: str) -> ExecutorFactory:
    """The factory of ``kind``, or ``UnknownStageKind`` naming the kinds this agent runs."""
    known = {DEFAULT_KIND: layers_executor, **registry.executor_kinds()}
    try:
        return known[kind]
    except KeyError:
        raise UnknownStageKind(
            f"this agent has no executor for stage kind {kind!r} (it runs: {', '.join(sorted(known))}); "
            "upgrade the agent to the studio's version"
        ) from None
