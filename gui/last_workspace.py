"""Reopening the studio restores the last workspace: the workspace file, the profile (as the
planning problem, with its source, exclusions, headroom and workload), the plan, the CNN time
models the Profile screen shows (spatial partitioning) and the Run screen's settings.

The problem, plan and CNN fits are written as the same ``edgeshard.problem`` / ``edgeshard.plan``
/ ``edgeshard.spatial-fits`` files the CLI reads, in ``core.paths.studio_folder()``; the workspace path and the Run
settings go to QSettings. Whatever is missing or damaged is skipped with a message saying
what was not restored and why; the rest is still restored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from core import formats
from core.errors import EdgeShardError
from core.paths import studio_folder
from core.planning.cost import evaluate
from core.planning.plan import ShardPlan, layout_problems
from core.planning.problem import PlanningProblem
from core.techniques.spatial.profiling import SpatialFits
from gui import app as studio_app
from gui.screens.run import MODES, NO_REPEAT_NGRAM_RANGE, REPETITION_PENALTY_RANGE, RunSettings

PROBLEM_FILE = "last-problem.json"
PLAN_FILE = "last-plan.json"
SPATIAL_FITS_FILE = "last-spatial-fits.json"
WORKSPACE_KEY = "last/workspace"
RUN_SETTINGS_KEY = "last/run_settings"


def save_last_workspace(state, run_settings: RunSettings | None, folder: Path | None = None) -> list[str]:
    """Keep what the next launch restores (``run_settings`` None: the Run screen was never built,
    the kept ones stay); returns what could not be kept (never raises)."""
    folder = folder or studio_folder()
    s = studio_app.settings()
    s.setValue(WORKSPACE_KEY, state.workspace)
    if run_settings is not None:
        s.setValue(RUN_SETTINGS_KEY, json.dumps(asdict(run_settings)))
    s.sync()
    failed = []
    for name, value in ((PROBLEM_FILE, state.problem), (PLAN_FILE, state.plan_for("layer-sharding")),
                        (SPATIAL_FITS_FILE, state.spatial_fits)):
        path = folder / name
        try:
            if value is None:
                path.unlink(missing_ok=True)
            else:
                folder.mkdir(parents=True, exist_ok=True)
                formats.save(path, value)
        except OSError as err:
            failed.append(f"could not keep {path} for the next launch ({err.strerror or err})")
    return failed


def restore_last_workspace(window, folder: Path | None = None) -> list[str]:
    """Restore the last workspace into ``window``; returns one message per part not restored."""
    folder = folder or studio_folder()
    state = window.state
    s = studio_app.settings()
    problems: list[str] = []

    workspace = s.value(WORKSPACE_KEY, "")
    if isinstance(workspace, str) and workspace:
        if Path(workspace).is_file():
            window.open_workspace(workspace)
        else:
            problems.append(f"the last workspace {workspace} is gone (moved or deleted): open one with File ▸ Open workspace…")

    problem = None
    problem_path = folder / PROBLEM_FILE
    if problem_path.exists():
        try:
            problem = formats.load(problem_path, PlanningProblem)
        except EdgeShardError as err:
            problems.append(f"the last profile could not be read ({err}): load one with File ▸ Load profile…")
        else:
            state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
            state.set_problem(problem)

    plan_path = folder / PLAN_FILE
    if plan_path.exists():
        why = ""
        try:
            plan = formats.load(plan_path, ShardPlan)
        except EdgeShardError as err:
            why = str(err)
        else:
            why = _plan_misfit(plan, problem)
            if not why:
                state.set_plan(plan)
        if why:
            problems.append(f"the last plan was not restored ({why}): Auto-solve (Ctrl+R) or File ▸ Load plan…")

    fits_path = folder / SPATIAL_FITS_FILE
    if fits_path.exists():
        try:
            state.set_spatial_fits(formats.load(fits_path, SpatialFits))
        except EdgeShardError as err:
            problems.append(f"the last CNN time models could not be read ({err}): press Profile CNN on the "
                            "Profile screen again")

    raw = s.value(RUN_SETTINGS_KEY, "")
    if isinstance(raw, str) and raw:
        try:
            window.screens.run.apply_settings(run_settings_from_json(raw))
        except ValueError as err:
            problems.append(f"the last Run settings were not restored ({err}); the defaults are shown")
    return problems


def _plan_misfit(plan: ShardPlan, problem: PlanningProblem | None) -> str:
    """Why ``plan`` cannot be the restored profile's plan ("" when it can)."""
    if problem is None:
        return "there is no profile to plan for"
    model = problem.profile.model
    if plan.model != model.name:
        return f"it is for model {plan.model!r}, the profile is of {model.name!r}"
    layout = layout_problems(plan, model.num_units)
    if layout:
        return "; ".join(layout)
    unknown = sorted(set(plan.devices()) - set(problem.profile.cluster.device_ids()))
    if unknown:
        return f"it uses devices the profile does not have: {', '.join(unknown)}"
    violations = evaluate(problem, plan).violations  # never reopen on a plan Start would refuse
    if violations:
        return "it does not fit the profile: " + "; ".join(violations)
    return ""


def run_settings_from_json(raw: str) -> RunSettings:
    """Run settings as saved by ``save_last_workspace``; ``ValueError`` saying what is wrong."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise ValueError("not valid JSON") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    expected = {f.name for f in fields(RunSettings)}
    unknown = sorted(set(data) - expected)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    checks = {
        "model_dir": lambda v: isinstance(v, str),
        "prompts": lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v),
        "max_new_tokens": lambda v: type(v) is int and 1 <= v <= 4096,
        "mode": lambda v: v in MODES,
        "micro_batches": lambda v: v is None or (type(v) is int and 1 <= v <= 64),
        "send_weights": lambda v: isinstance(v, bool),
        "on_failure": lambda v: v in ("replan", "stop"),
        "repetition_penalty": lambda v: type(v) in (int, float) and REPETITION_PENALTY_RANGE[0] <= v
                                        <= REPETITION_PENALTY_RANGE[1],
        "no_repeat_ngram_size": lambda v: type(v) is int and NO_REPEAT_NGRAM_RANGE[0] <= v <= NO_REPEAT_NGRAM_RANGE[1],
        "frequency_penalty": lambda v: type(v) in (int, float) and -2 <= v <= 2,
        "presence_penalty": lambda v: type(v) in (int, float) and -2 <= v <= 2,
        "draft_dir": lambda v: isinstance(v, str),
        "speculate_k": lambda v: v is None or (type(v) is int and 1 <= v <= 8),
        "speculate_seed": lambda v: type(v) is int and 0 <= v <= 999,
    }
    for name, ok in checks.items():
        if name in data and not ok(data[name]):
            raise ValueError(f"{name} = {data[name]!r} is not valid")
    missing = sorted(n for n in ("model_dir", "prompts", "max_new_tokens", "mode") if n not in data)
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    return RunSettings(**{**data, "prompts": tuple(data["prompts"])})
