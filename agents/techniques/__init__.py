"""The built-in techniques' rooms on the agent, registered with ``agents.registry`` on import.

Each room (``agents.techniques.<name>``) holds one technique's agent side: its wire (control
messages, options on shared messages, data-frame kinds), its handlers and its stage executors,
described by one ``AgentTechnique``. Rooms never import each other, and the shared agent modules
never import a room (import-linter contracts in pyproject.toml): this bootstrap is what lists
them, like ``core.techniques.BUILTIN``. Whoever runs an agent or decodes its frames imports it
(the agent's entry ``agents.__main__``, the coordinator's agent link); a technique that lives
elsewhere registers its own ``AgentTechnique`` (an agent loads it with ``--technique-module``).
"""

from __future__ import annotations

from agents import registry
from agents.techniques import attention_offload, expert_offload, open_run, phase_disaggregation, spatial, speculative

BUILTIN = (expert_offload.TECHNIQUE, attention_offload.TECHNIQUE, spatial.TECHNIQUE, phase_disaggregation.TECHNIQUE,
           open_run.TECHNIQUE, speculative.TECHNIQUE)

for _technique in BUILTIN:
    registry.register(_technique)
