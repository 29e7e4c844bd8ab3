"""MoE expert offloading's views: its plan view (scenario, plan, Compare) and its run view, the
expert heat map the Run and Sessions screens show for its runs. Nothing is imported here: the
Run screen loads the heat map at start-up, the plan view only when first shown."""
