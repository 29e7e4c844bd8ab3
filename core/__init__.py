"""The domain and the operator-side machinery. Pure Python: never imports Qt or gui/."""

from core.cluster import Cluster, Device, Link
from core.errors import EdgeShardError, FormatError, ModelDoesNotFit, PlanInvalid
from core.model_units import ModelSpec, ModelUnit
from core.plan import ShardPlan, Stage
from core.problem import PlanningProblem, Workload
from core.profile import DeviceTimes, Profile

__all__ = [
    "Cluster", "Device", "Link", "EdgeShardError", "FormatError", "ModelDoesNotFit",
    "PlanInvalid", "ModelSpec", "ModelUnit", "ShardPlan", "Stage", "PlanningProblem",
    "Workload", "DeviceTimes", "Profile",
]
