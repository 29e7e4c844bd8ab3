"""The technique seam: what one placement technique brings, and the registry of them.

The studio offers several techniques (layer sharding; later attention offloading, expert
offloading, spatial CNN partitioning, phase disaggregation). They differ in *what* they
place; everything around the placement is shared and technique-agnostic: devices, the wire
format, the run state, ``TimelineEvent``s, recording, replay, export, the timeline and the
Compare view. So a technique is one ``Technique`` value naming its own parts, and shared
code asks the registry for it instead of importing a technique.

Adding a technique: one folder ``core/techniques/<name>/`` whose ``__init__`` defines
``TECHNIQUE``, its agent side in a room ``agents/techniques/<name>/`` (one
``agents.registry.AgentTechnique``: its messages, data kinds, handlers and stage kinds'
executors), its plan view in ``gui/`` (``gui.techniques``),
and one registration line: ``BUILTIN`` below, or an ``edgeshard.techniques`` entry point
for a technique that lives outside this tree. docs/architecture.md draws the whole house.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Literal, Protocol

from core.errors import EdgeShardError
from core.models.units import ModelSpec
from core.reporting import Reporter

Objective = Literal["latency", "throughput"]

BUILTIN = (
    "core.techniques.layer_sharding",
    "core.techniques.spatial",
    "core.techniques.attention_offload",
    "core.techniques.expert_offload",
    "core.techniques.phase_disaggregation",
)
"""The techniques that ship with the studio: one line each (module defining ``TECHNIQUE``)."""

ENTRY_POINT_GROUP = "edgeshard.techniques"


class UnknownTechnique(EdgeShardError):
    """A plan, run or command names a technique this studio does not have."""

    exit_code = 2


class StrategyOutcomeLike(Protocol):
    """What a strategy of any technique gives the shared Compare view and ``edgeshard compare``.

    Each technique keeps its own outcome type (its plan and cost differ); these are the
    fields every one of them has, so strategies line up in one table. A technique's type
    extends ``core.techniques.outcomes.StrategyOutcome``, which holds them once.
    """

    strategy: str
    objective: str
    status: str
    """optimal | ok | oom | invalid | failed"""
    plan: Any
    error: str
    elapsed_s: float

    @property
    def latency_s(self) -> float | None: ...

    @property
    def tokens_per_s(self) -> float | None: ...


class StrategyRunner(Protocol):
    """Run one named strategy (an exact solver or a baseline); operator errors become ``failed``."""

    def __call__(self, problem: Any, name: str, objective: str, time_limit_s: float = 30.0, *,
                 reporter: Reporter | None = None) -> StrategyOutcomeLike: ...


@dataclass(frozen=True)
class Technique:
    """One placement technique's parts. Shared code reaches a technique only through these."""

    name: str
    """Stable identifier stored with plans and runs (``layer-sharding``)."""
    title: str
    """What the studio shows (``Layer sharding (EdgeShard)``)."""
    applies_to: Callable[[ModelSpec], bool]
    """Whether the technique can place this model (e.g. MoE offloading needs experts)."""
    stage_kinds: tuple[str, ...]
    """The kinds of stage its plans hold; agents pick an executor by kind."""
    strategies: Mapping[str, Any]
    """Its exact solver(s) and baselines, by the name the CLI and Compare show (values: its own)."""
    exact: str
    """The strategy that is proven optimal (listed first, the default of ``plan``)."""
    run_strategy: StrategyRunner
    """Runs one of ``strategies`` on a problem of this technique."""
    cost: Callable[[Any, Any], Any]
    """Its cost model: ``cost(problem, plan)`` — the one the solvers, the editor and the simulator use."""
    simulate: Callable[..., Any]
    """Its simulated schedule: ``simulate(problem, plan, mode, ...)`` -> a result with the same
    ``TimelineEvent``s a real run records (``.events``, ``.tokens``, ``.figures``)."""
    run_plan: Callable[..., Any] | None = None
    """``run_plan(plan, model_dir)`` -> the ``ShardPlan`` (stages of this technique's kinds) that
    ``edgeshard run`` and the Run screen run for one of its plans on agents; None when its plans
    are shard plans already (layer sharding) or it runs another way."""
    run_generation: Callable[..., Any] | None = None
    """``run_generation(coordinator, plan, model_dir, prompts, settings, *, sink, reporter, options=None)``
    -> ``core.runs.generation.Generation`` (``options``: the technique's own run options, e.g.
    attention offloading's ``OffloadRunOptions``, from the Run screen): how the Run screen runs a ``ShardPlan`` whose stages are of
    its kinds when the shared ``core.runs.generation.generate`` cannot (its stages call agents
    outside the plan, e.g. attention offloading's memory agents); None: the shared ``generate``.
    Run surfaces find it with ``generation_for(plan)``."""
    register_cli: Callable[[argparse._SubParsersAction], None] | None = None
    """Its own CLI verbs, if any beyond the shared ``plan``/``compare``/``run``."""
    plan_format: str = ""
    """The JSON ``format`` of its plan files when they are not shard plans (``edgeshard.spatial-plan``)."""
    run_plan_file: Callable[[argparse.Namespace, Any], int] | None = None
    """``edgeshard run --plan FILE`` for a file of ``plan_format``: ``run_plan_file(args, agents)`` runs
    it with the parsed ``run`` arguments (``--problem``, ``--image``, ...) on ``agents`` ((endpoints,
    keys) from ``--agents``; None with ``--local``) and returns the exit code."""
    paper: str = ""
    modes: tuple[str, ...] = field(default=())
    """The run modes its schedule knows."""
    compare_names: Callable[[Any], list[str]] | None = None
    """The strategies Compare shows for a problem, if not always ``strategy_names()`` (layer sharding
    adds its fp-only optimum beside the precision-aware one under a quality bound)."""
    replanner: Callable[[Any, str], Any] | None = None
    """``replanner(problem, model_dir)`` -> the ``core.runs.recovery.Replanner`` that re-plans a run of
    its stages over the survivors with its own memory model (expert offloading: resident weights and a
    buffer); None: layer sharding's ``ExactReplanner``. Run surfaces find it with ``replanner_for``."""
    problem_type: type | None = None
    plan_type: type | None = None
    """The msgspec types of its problem and plan: what a run's recorded origin (``core.sessions.origin``)
    decodes into, so a replay is predicted by ``simulate`` as the live run was (None: not recorded)."""

    def strategy_names(self) -> list[str]:
        """The exact strategy first, then the baselines by name."""
        return sorted(self.strategies, key=lambda n: (n != self.exact, n))

    def compare(self, problem: Any, objective: Objective, time_limit_s: float = 30.0) -> list[StrategyOutcomeLike]:
        """Every strategy side by side: what the shared Compare view shows."""
        names = self.strategy_names() if self.compare_names is None else self.compare_names(problem)
        return [self.run_strategy(problem, n, objective, time_limit_s) for n in names]


def cli_of(module: str) -> Callable[[argparse._SubParsersAction], None]:
    """A ``register_cli`` that calls ``register(sub)`` of the technique's CLI ``module``, imported
    only when the parser is built (so loading a technique never loads its command line)."""

    def register_cli(sub: argparse._SubParsersAction) -> None:
        importlib.import_module(module).register(sub)

    return register_cli


_REGISTRY: dict[str, Technique] = {}
_LOADED = False


def register(technique: Technique) -> Technique:
    """Make a technique known to the studio (its module calls this, or a test does)."""
    other = _REGISTRY.get(technique.name)
    if other is not None and other is not technique:
        raise ValueError(f"technique {technique.name!r} is registered twice")
    _REGISTRY[technique.name] = technique
    return technique


def unregister(name: str) -> None:
    """Forget a technique (tests that plug one in take it out again)."""
    _REGISTRY.pop(name, None)


def _load_registered() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for module in BUILTIN:
        register(importlib.import_module(module).TECHNIQUE)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        technique = ep.load()
        if not isinstance(technique, Technique):
            raise TypeError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP} is not a Technique: {ep.value}")
        register(technique)


def techniques() -> list[Technique]:
    """Every known technique, in registration order (the shipped ones first)."""
    _load_registered()
    return list(_REGISTRY.values())


def technique_named(name: str) -> Technique:
    """The technique of that name, or ``UnknownTechnique`` listing the known ones."""
    _load_registered()
    if name not in _REGISTRY:
        raise UnknownTechnique(f"unknown technique {name!r}; this studio has: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def generation_for(plan) -> Callable[..., Any] | None:
    """The ``run_generation`` of the technique whose stage kinds ``plan``'s stages have (None: the
    shared ``generate`` runs it). Technique-neutral: the Run screen asks this, never a technique."""
    kinds = {getattr(s, "kind", "layers") for s in plan.stages}
    for technique in techniques():
        if technique.run_generation is not None and kinds & set(technique.stage_kinds):
            return technique.run_generation
    return None


def replanner_for(plan, problem, model_dir: str):
    """The re-planner of ``--on-failure replan`` for ``plan``: its technique's own (by stage kinds), else
    layer sharding's exact one. Technique-neutral, like ``generation_for``."""
    kinds = {getattr(s, "kind", "layers") for s in plan.stages}
    for technique in techniques():
        if technique.replanner is not None and kinds & set(technique.stage_kinds):
            return technique.replanner(problem, model_dir)
    from core.runs.recovery import ExactReplanner

    return ExactReplanner(problem)


def technique_of_plan(plan) -> str:
    """The name of the technique whose stage kinds ``plan``'s stages have (``layer-sharding`` for
    plain ``layers`` stages): the studio keeps each technique's plan apart by this name, so running
    one technique's plan never replaces another's."""
    kinds = {getattr(s, "kind", "layers") for s in plan.stages} - {"layers"}  # a technique's own kind decides
    for technique in techniques():
        if kinds & set(technique.stage_kinds):
            return technique.name
    return "layer-sharding"


def technique_for_plan_format(fmt: str) -> Technique | None:
    """The technique whose own plan files have the JSON format ``fmt`` (None: a shard plan's or unknown)."""
    return next((t for t in techniques() if t.plan_format and t.plan_format == fmt), None)


def techniques_for(model: ModelSpec) -> list[Technique]:
    """The techniques that can place ``model`` (the studio offers only these)."""
    return [t for t in techniques() if t.applies_to(model)]


__all__ = [
    "BUILTIN", "Objective", "cli_of", "generation_for", "replanner_for", "technique_for_plan_format", "technique_of_plan", "StrategyOutcomeLike", "StrategyRunner", "Technique", "UnknownTechnique", "register",
    "technique_named", "techniques", "techniques_for", "unregister",
]
