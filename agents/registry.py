"""The one registry of the agent's techniques: their wire types, data-frame kinds, handlers and
stage executors.

The shared agent (control plane, lease, the stage run, transport, the base protocol) names no
technique. A technique's room (``agents.techniques.<name>``) describes itself as one
``AgentTechnique`` and registers it here; ``agents.techniques`` registers the built-in rooms (its
``BUILTIN``), and an agent started with ``--technique-module`` registers a room from outside
``agents/`` the same way. From the registrations:

- ``agents.protocol`` builds its total control decoder (the base messages plus every registered
  message type, one tagged union, strictly decoded and range-checked by each type's ``problem``),
  decodes the ``options`` slots of ``LoadShard``/``StartRun``/``DataHeader`` by their ``kind`` tag,
  and accepts a data frame's ``kind`` only when it is a base kind or a registered one;
- the agent finds the ``Handler`` of a message by its type (how it is admitted, whether it takes
  the agent's run and lease, what it does on the worker) and a stage kind's executor factory.

Like transformers' ``AttentionInterface`` (the model never learns which attention it calls) and
vLLM's KV-connector interface (one interface, many implementations).
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec


@dataclass(frozen=True)
class DataKind:
    """A data-frame kind a technique sends over the data plane (``DataHeader.kind``).

    ``options``: the ``agents.envelope.Options`` struct its ``DataHeader.options`` holds (None: the
    frame carries none); ``required``: whether every frame of the kind carries it."""

    name: str
    options: type | None = None
    required: bool = True


@dataclass(frozen=True)
class Handler:
    """How an agent serves one message type of a technique, under the agent's one-work-at-a-time
    rule (``agents.agent``).

    ``serve(agent, msg, stop)`` runs on the worker thread; what it returns (a reply) is posted to
    the requester. ``on_control(agent, identity, msg)`` instead serves it on the control thread (it
    must not block: a hand-over to a running session). ``admit(agent, msg)`` -> ``(code, text)``
    refuses it on the control thread before any work (None: admitted). ``takes_run``: it starts a
    held session that is the agent's run (``run_id``, ``lease_s``), stopped by a ``StopRun``.
    ``exclusive``: refused while the agent runs or loads other work; ``replaces_stage``: refused on a
    ready agent whose stage another coordinator loaded and still speaks to. ``wanted`` says what the
    refused request wanted (``cannot <wanted>: busy with ...``); ``describe(agent, msg)`` what the
    agent serves while it runs. ``activity``: the agent's status activity while it is served."""

    message: type
    serve: Callable[..., Any] | None = None
    on_control: Callable[..., None] | None = None
    admit: Callable[..., tuple[str, str] | None] | None = None
    takes_run: bool = False
    exclusive: bool = False
    replaces_stage: bool = False
    wanted: str = ""
    describe: Callable[..., str] | None = None
    activity: str = ""


@dataclass(frozen=True)
class AgentTechnique:
    """Everything a technique adds to the agent, registered at once (``register``).

    ``messages``: its control message types (``agents.envelope.Message`` subclasses with their own
    tags and ``problem`` checks); ``options``: its ``agents.envelope.Options`` structs for the shared
    messages' options slots; ``data_kinds``; ``handlers``; ``executors``: stage kind -> factory
    (``LoadShard.kind``); ``run_drivers``: ``StartRun.options`` type -> ``driver(agent, loaded, msg,
    stop)`` returning the run's tokens per sequence (a run the technique schedules itself);
    ``profilers``: profiling options type -> ``profile(options, slowdown)`` (a measurement only its
    technique's planner needs, asked with a ``ProfileCompute``; ``run_profiler``);
    ``free_memory(agent)``: drop what it keeps between requests before a stage or a hold needs the
    memory; ``on_unload(agent)``: close what it holds for the loaded stage."""

    name: str
    messages: tuple[type, ...] = ()
    options: tuple[type, ...] = ()
    data_kinds: tuple[DataKind, ...] = ()
    handlers: tuple[Handler, ...] = ()
    executors: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    run_drivers: Mapping[type, Callable[..., Any]] = field(default_factory=dict)
    profilers: Mapping[type, Callable[..., Any]] = field(default_factory=dict)
    free_memory: Callable[[Any], None] | None = None
    on_unload: Callable[[Any], None] | None = None


class RegistryConflict(ValueError):
    """A registration that would make one tag, kind or stage kind mean two things."""


BASE_DATA_KINDS = ("hidden", "tokens", "probe")
"""The shared stage run's kinds (activations, sampled token ids) and the link probe's."""

_lock = threading.Lock()
_techniques: dict[str, AgentTechnique] = {}
_generation = 0
"""Bumped on every change: the protocol's decoders are rebuilt when it moved."""


def _tags(types) -> set[str]:
    return {t.__struct_config__.tag for t in types}


def register(technique: AgentTechnique) -> None:
    """Add ``technique`` (registering the same one again is a no-op). Refused when one of its message
    tags, options kinds, data kinds or stage kinds is another technique's, or its messages are not
    tagged control messages: the decoder could not tell them apart."""
    global _generation
    with _lock:
        if _techniques.get(technique.name) is technique:
            return
        if technique.name in _techniques:
            raise RegistryConflict(f"an agent technique named {technique.name!r} is already registered")
        for t in (*technique.messages, *technique.options):
            if not (isinstance(t, type) and issubclass(t, msgspec.Struct) and isinstance(t.__struct_config__.tag, str)):
                raise RegistryConflict(f"{t!r} is not a tagged msgspec struct")
        for other in _techniques.values():
            clash = (_tags(technique.messages) & _tags(other.messages)
                     or _tags(technique.options) & _tags(other.options)
                     or {k.name for k in technique.data_kinds} & {k.name for k in other.data_kinds}
                     or set(technique.executors) & set(other.executors))
            if clash:
                raise RegistryConflict(f"technique {technique.name!r} reuses {sorted(clash)} of {other.name!r}")
        clash = {k.name for k in technique.data_kinds} & set(BASE_DATA_KINDS)
        if clash:
            raise RegistryConflict(f"technique {technique.name!r} reuses the base data kinds {sorted(clash)}")
        _techniques[technique.name] = technique
        _generation += 1


def unregister(name: str) -> None:
    global _generation
    with _lock:
        if _techniques.pop(name, None) is not None:
            _generation += 1


def generation() -> int:
    return _generation


def techniques() -> tuple[AgentTechnique, ...]:
    """The registered techniques, in registration order."""
    return tuple(_techniques.values())


def message_types() -> tuple[type, ...]:
    return tuple(t for tech in techniques() for t in tech.messages)


def option_types() -> tuple[type, ...]:
    return tuple(t for tech in techniques() for t in tech.options)


def data_kind(name: str) -> DataKind | None:
    """A registered technique's data kind (None for a base or an unknown kind)."""
    for tech in techniques():
        for kind in tech.data_kinds:
            if kind.name == name:
                return kind
    return None


def handler_for(message_type: type) -> Handler | None:
    for tech in techniques():
        for handler in tech.handlers:
            if handler.message is message_type:
                return handler
    return None


def run_driver_for(options_type: type) -> Callable[..., Any] | None:
    for tech in techniques():
        driver = tech.run_drivers.get(options_type)
        if driver is not None:
            return driver
    return None


def run_profiler(options, slowdown: float = 1.0):
    """Measure ``options`` with the profiler a registered technique gave for their type."""
    for tech in techniques():
        profile = tech.profilers.get(type(options))
        if profile is not None:
            return profile(options, slowdown)
    raise ValueError(f"no technique on this agent profiles {type(options).__name__}")


def executor_kinds() -> dict[str, Callable[..., Any]]:
    """Stage kind -> executor factory over every registered technique."""
    return {kind: factory for tech in techniques() for kind, factory in tech.executors.items()}


TECHNIQUES_ENV = "EDGESHARD_AGENT_TECHNIQUES"
"""Environment variable naming technique modules (comma-separated) an agent loads at start, beside
``--technique-module`` (a local cluster's agents inherit the launcher's environment)."""

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class TechniqueModuleError(ValueError):
    """A technique module an agent was told to load that it cannot: named, with why, in one line."""


def load_technique_modules(names) -> tuple[AgentTechnique, ...]:
    """Import each named module from this machine's own Python path and register its
    ``AGENT_TECHNIQUE``. Only names the operator gave the agent at start (its command line, its
    environment) are imported, never one that arrives over the network; a name that is not a module
    path, does not import, or defines no ``AgentTechnique`` is a ``TechniqueModuleError``."""
    loaded = []
    for name in names:
        if not _MODULE_NAME.match(name):
            raise TechniqueModuleError(f"technique module {name!r} is not a Python module name (like pkg.module)")
        try:
            module = importlib.import_module(name)
        except Exception as err:  # ImportError, or the module's own failure: named, the agent does not start
            raise TechniqueModuleError(f"cannot import technique module {name!r}: {type(err).__name__}: {err}") from None
        technique = getattr(module, "AGENT_TECHNIQUE", None)
        if not isinstance(technique, AgentTechnique):
            raise TechniqueModuleError(f"technique module {name!r} defines no AGENT_TECHNIQUE "
                                       "(an agents.registry.AgentTechnique)")
        try:
            register(technique)
        except RegistryConflict as err:
            raise TechniqueModuleError(f"technique module {name!r}: {err}") from None
        loaded.append(technique)
    return tuple(loaded)


def technique_module_names(option_values, environ) -> list[str]:
    """The modules to load: ``--technique-module`` values, then the environment's (deduplicated)."""
    listed = (name.strip() for name in environ.get(TECHNIQUES_ENV, "").split(","))
    names = [*(option_values or ()), *(name for name in listed if name)]
    return list(dict.fromkeys(names))
