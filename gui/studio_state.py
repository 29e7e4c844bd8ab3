"""What every screen of the studio shares: workspace, cluster, profile, problem and plan.

Screens never talk to each other directly; they set values here and react to the
past-tense signals. Values are the immutable core types, so a screen can keep a
reference without copying. Setting an equal value emits nothing.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from core.devices.cluster import Cluster
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem, Workload, default_problem, with_changes
from core.devices.profile import Profile


class StudioState(QObject):
    workspace_changed = Signal(str)
    cluster_changed = Signal(object)
    """Cluster | None: the devices the planner may use and the measured links."""
    profile_changed = Signal(object)
    problem_changed = Signal(object)
    spatial_fits_changed = Signal(object)
    technique_models_changed = Signal(object)
    """dict[str, str]: a model of its own per technique (the demo's tour), ``technique_models``."""
    plan_changed = Signal(object)
    plan_solving_changed = Signal(bool)
    """Whether the plan of a new profile is being solved (``plan_solving``): until it lands the plan is
    the placeholder the Plan screen flags, and Start waits for it instead of refusing."""
    model_changed = Signal(str)
    technique_changed = Signal(str)
    """The technique shown on the Plan screen or whose plan was last set (``technique``)."""
    connection_changed = Signal(str)
    agents_changed = Signal(object)
    """The connected agents' ``Coordinator`` (demo cluster or agents.json), or None."""
    offline_changed = Signal(object)
    """tuple[str, ...]: the devices now offline."""
    run_options_proposed = Signal(object, int)
    """(technique run options, micro-batches; 0: the plan's): how the Plan screen proposes to run
    the plan it just set (attention offloading's compute replicas and staggering); the Run screen
    shows them."""
    last_run_changed = Signal()
    """A run on the Run screen ended: ``last_run_events`` / ``last_run_tokens`` are what it measured."""
    log_added = Signal(str, str)
    """(level, text): level is "info", "warning" or "error"."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.workspace: str = ""
        self.cluster: Cluster | None = None
        self.profile: Profile | None = None
        self.problem: PlanningProblem | None = None
        self.plan: ShardPlan | None = None
        """The plan the Run screen runs: the last one set, of whichever technique."""
        self.plan_solving = False
        self.plans: dict[str, ShardPlan] = {}
        """Each technique's own plan (``core.techniques.technique_of_plan``): running attention
        offloading never replaces the layer-sharding plan the editor shows."""
        self.plan_origins: dict[str, object] = {}
        """Technique name -> the ``core.runs.prediction.PlanOrigin`` its plan was made from (``plan_origin``)."""
        self.model_name: str = ""
        self.model_path: str = ""
        """Checkpoint directory of the selected model, when it can be run."""
        self.technique: str = ""
        """The technique being shown or run: the status bar names its model (``model_for``)."""
        self.connection: str = "not connected"
        self.offline_devices: tuple[str, ...] = ()
        self.agents = None
        self.spatial_fits = None
        """The CNN time models (``core.techniques.spatial.profiling.SpatialFits``) last profiled on
        agents or loaded from a spatial problem: the Profile screen shows them."""
        self.technique_models: dict[str, str] = {}
        """Technique name -> the checkpoint its views plan and run (the demo's tour gives each technique
        a model of its kind: ``gui.demo_model.demo_checkpoints``); the Plan screen offers these techniques
        whatever the LLM's family."""
        """The connected agents' ``Coordinator`` (techniques with their own run driver use its link)."""
        self.last_run_events: tuple = ()
        self.last_run_tokens: tuple = ()
        """The last run's timeline and token events (the Cluster screen's measured traffic)."""
        self.live_run_ids: set[int] = set()
        """Runs being recorded right now: a stored "running" run not in here was interrupted."""

    def set_workspace(self, path: str) -> None:
        if path != self.workspace:
            self.workspace = path
            self.workspace_changed.emit(path)

    def set_cluster(self, cluster: Cluster | None) -> None:
        if cluster != self.cluster:
            self.cluster = cluster
            self.cluster_changed.emit(cluster)

    def set_offline(self, devices: tuple[str, ...]) -> None:
        if tuple(devices) != self.offline_devices:
            self.offline_devices = tuple(devices)
            self.offline_changed.emit(self.offline_devices)

    def set_agents(self, coordinator) -> None:
        if coordinator is not self.agents:
            self.agents = coordinator
            self.agents_changed.emit(coordinator)

    def set_spatial_fits(self, fits) -> None:
        if fits != self.spatial_fits:
            self.spatial_fits = fits
            self.spatial_fits_changed.emit(fits)

    def set_technique_models(self, models: dict[str, str]) -> None:
        if models != self.technique_models:
            self.technique_models = dict(models)
            self.technique_models_changed.emit(dict(models))

    def set_model(self, name: str, path: str = "") -> None:
        self.model_path = path or self.model_path
        if name != self.model_name:
            self.model_name = name
            self.model_changed.emit(name)

    def set_profile(self, profile: Profile | None, source: str | None = None, workload: Workload | None = None) -> None:
        """A new profile also makes a new planning problem (its source defaults to the first device)."""
        self.profile = profile
        self.profile_changed.emit(profile)
        if profile is None:
            self.set_problem(None)
            return
        self.set_cluster(profile.cluster)
        self.set_model(profile.model.name)
        prev = self.problem  # keep what the operator chose for the previous profile, where it still fits
        if source is None and prev is not None and prev.source in {t.device for t in profile.times}:
            source = prev.source
        if workload is None and prev is not None:
            workload = prev.workload
        self.set_problem(default_problem(profile, source, workload))

    def set_problem(self, problem: PlanningProblem | None) -> None:
        if problem is self.problem:
            return
        self.problem = problem
        self.problem_changed.emit(problem)

    def update_problem(self, **changes) -> None:
        """Replace fields of the current problem (source, excluded devices, headroom, workload);
        raises ``FormatError`` naming the field for an invalid value (``core.planning.problem.with_changes``)."""
        if self.problem is not None:
            self.set_problem(with_changes(self.problem, **changes))

    def set_plan_solving(self, solving: bool) -> None:
        if solving != self.plan_solving:
            self.plan_solving = solving
            self.plan_solving_changed.emit(solving)

    def set_plan(self, plan: ShardPlan | None, origin=None) -> None:
        """Make ``plan`` the one to run, and its technique's plan; None clears only the current one.
        ``origin``: the technique's own problem and plan it was made from (``PlanOrigin``), which
        predicts its run."""
        if plan is not None:
            from core.techniques import technique_of_plan

            key = technique_of_plan(plan)
            if origin is not None:
                self.plan_origins[key] = origin
            elif self.plans.get(key) != plan:  # another plan of it (a re-plan): its origin no longer holds
                self.plan_origins.pop(key, None)
            self.plans[key] = plan
            self._set_technique(key)
        if plan != self.plan:
            self.plan = plan
            self.plan_changed.emit(plan)

    def clear_plan(self, technique: str) -> None:
        """Forget ``technique``'s plan (undoing its first plan); the current one too when it is that."""
        plan = self.plans.pop(technique, None)
        if plan is not None and plan == self.plan:
            self.plan = None
            self.plan_changed.emit(None)

    def plan_origin(self, plan: ShardPlan):
        """What predicts ``plan``'s run (``core.runs.prediction.PlanOrigin``): the origin its technique's
        view set with it; a plan of plain layer stages comes from the studio's problem; None: nothing
        predicts it (better no ghosts than another technique's)."""
        from core.runs.prediction import PlanOrigin
        from core.techniques import technique_named, technique_of_plan

        technique = technique_of_plan(plan)
        origin = self.plan_origins.get(technique)
        if origin is not None and self.plans.get(technique) == plan:
            return origin
        if self.problem is not None and all(getattr(s, "kind", "layers") == "layers" for s in plan.stages):
            return PlanOrigin(technique_named(technique), self.problem, plan)
        return None

    def plan_for(self, technique: str) -> ShardPlan | None:
        """``technique``'s own plan (None before it has one)."""
        return self.plans.get(technique)

    def use_technique(self, technique: str) -> None:
        """The Plan screen shows ``technique``: its own plan, when it has one, becomes the one to run."""
        plan = self.plans.get(technique)
        if plan is not None:
            self.set_plan(plan)
        self._set_technique(technique)

    def _set_technique(self, technique: str) -> None:
        if technique != self.technique:
            self.technique = technique
            self.technique_changed.emit(technique)

    def model_for(self, technique: str) -> str:
        """The name of the model ``technique`` plans and runs: its own checkpoint's folder (the demo's
        MoE for expert offloading), else the studio's model (the demo's Llama)."""
        from pathlib import Path

        own = self.technique_models.get(technique, "")
        if not own or (self.model_path and Path(own).resolve() == Path(self.model_path).resolve()):
            return self.model_name
        return Path(own).name

    def propose_run_options(self, options: dict, micro_batches: int = 0) -> None:
        self.run_options_proposed.emit(dict(options), int(micro_batches))

    def set_last_run(self, events, tokens) -> None:
        self.last_run_events, self.last_run_tokens = tuple(events), tuple(tokens)
        self.last_run_changed.emit()

    def set_connection(self, text: str) -> None:
        if text != self.connection:
            self.connection = text
            self.connection_changed.emit(text)

    def log(self, text: str, level: str = "info") -> None:
        self.log_added.emit(level, text)
