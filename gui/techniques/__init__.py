"""Each technique's plan view and run view, one module (or package) per technique: the GUI side
of the technique seam (core.techniques).

Each technique brings its own plan view (layer sharding: the plan editor with draggable stage
boundaries) and registers it here by ``Technique.name``; the Plan screen
(``gui.screens.plan.PlanScreen``) shows the chosen one. A view is imported only when first
built, and technique modules never import each other (import-linter contract).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from PySide6.QtWidgets import QWidget

from gui.studio_state import StudioState


class PlanView(Protocol):
    """What the Plan screen and the menus ask of a technique's plan view (a QWidget)."""

    def auto_solve(self) -> None: ...

    def compare(self) -> None: ...


PlanViewFactory = Callable[[StudioState], QWidget]

_VIEWS: dict[str, PlanViewFactory] = {}


def register_plan_view(technique: str, factory: PlanViewFactory) -> None:
    """Give a technique (by ``Technique.name``) its plan view."""
    _VIEWS[technique] = factory


def unregister_plan_view(technique: str) -> None:
    _VIEWS.pop(technique, None)


def has_plan_view(technique: str) -> bool:
    return technique in _VIEWS


def plan_view_factory(technique: str) -> PlanViewFactory:
    """What builds that technique's plan view (KeyError: it has none)."""
    return _VIEWS[technique]


def _layer_sharding_view(state: StudioState) -> QWidget:
    from gui.techniques.layer_sharding.editor import PlanEditorPanel

    return PlanEditorPanel(state)


def _spatial_view(state: StudioState) -> QWidget:
    from gui.techniques.spatial import SpatialPlanView

    return SpatialPlanView(state)


def _attention_offload_view(state: StudioState) -> QWidget:
    from gui.techniques.attention_offload import AttentionOffloadPlanView

    return AttentionOffloadPlanView(state)


def _expert_offload_view(state: StudioState) -> QWidget:
    from gui.techniques.expert_offload.plan_view import ExpertOffloadPlanView

    return ExpertOffloadPlanView(state)


def _phase_disaggregation_view(state: StudioState) -> QWidget:
    from gui.techniques.phase_disaggregation import PhaseDisaggregationPlanView

    return PhaseDisaggregationPlanView(state)


register_plan_view("layer-sharding", _layer_sharding_view)
register_plan_view("spatial", _spatial_view)
register_plan_view("attention-offload", _attention_offload_view)
register_plan_view("expert-offload", _expert_offload_view)
register_plan_view("phase-disaggregation", _phase_disaggregation_view)
