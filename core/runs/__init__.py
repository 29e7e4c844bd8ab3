"""Running a plan on agents, and predicting it.

Public: ``coordinator`` (drives agents: load, run, stop; streams TimelineEvents; offers
``run_stream``'s values and sinks),
``generation`` (prompts in, text out), ``batching`` (a run's micro-batches: the plan's
count or the operator's override), ``metrics`` (TTFT, tokens/s, utilisation from
events), ``simulator`` (the predicted timeline), ``prediction`` (simulation as long work).
"""
