"""Running a plan on agents, and predicting it.

Public: ``coordinator`` (drives agents: load, run, stop; streams TimelineEvents),
``generation`` (prompts in, text out), ``metrics`` (TTFT, tokens/s, utilisation from
events), ``simulator`` (the predicted timeline), ``prediction`` (simulation as long work).
"""
