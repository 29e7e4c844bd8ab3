"""How a model is split over devices: the decisions, as pure functions.

Public: ``problem`` (PlanningProblem, Workload), ``plan`` (ShardPlan, Stage), ``edits``
(hand edits of a plan), ``cost`` (the one cost model), ``scenarios`` (synthetic clusters
such as the paper's testbed), ``solvers`` (exact solvers and baselines).
"""
