"""EPD's views: the plan view (a problem measured on the agents or the what-if scenario, the
search, the baselines) with *Run on agents* (``agent_run``) and the drawings they share
(``drawings``: the pools, the request timeline)."""

from gui.techniques.phase_disaggregation.drawings import PoolsDiagram, RequestTimeline
from gui.techniques.phase_disaggregation.plan_view import EpdPlanResult, PhaseDisaggregationPlanView, plan_epd

__all__ = ["EpdPlanResult", "PhaseDisaggregationPlanView", "PoolsDiagram", "RequestTimeline", "plan_epd"]
