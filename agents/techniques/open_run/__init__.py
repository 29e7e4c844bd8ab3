"""Open runs on agents: continuous batching across a layer-sharded pipeline.

A run that starts empty; micro-batches join it between steps (``JoinRun``) and leave it
(``LeaveRun``, or done), their KV caches retired at once down the ring, until it is stopped. The
server (``core.serving``) keeps one open per loaded plan so several users' requests keep a
multi-stage plan's stages busy. ``messages``: its wire; ``session``: the stage run it drives.
Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.protocol import AgentState, Ok
from agents.registry import AgentTechnique, DataKind, Handler
from agents.techniques.open_run.messages import OPEN_RUN_MESSAGES, RETIRE, SHRINK, JoinRun, LeaveRun, OpenRunOptions


def hand_over(agent, identity, msg: JoinRun | LeaveRun):
    """To the open run on this agent, on the control thread: queued for the run, its receive woken."""
    if msg.run_id != agent.run_id or agent.state is not AgentState.RUNNING:
        return "bad_state", f"run {msg.run_id!r} is not running on {agent.device}"
    from agents.techniques.open_run.session import handed

    handed(agent, msg.run_id).append(msg)
    agent.run_stop.wake()
    agent.post(Ok(req=msg.req, detail="handed over"), to=identity)
    return None


def drive(agent, loaded, msg, stop):
    from agents.techniques.open_run.session import drive as run

    return run(agent, loaded, msg, stop)


TECHNIQUE = AgentTechnique(
    name="open-run",
    messages=OPEN_RUN_MESSAGES,
    options=(OpenRunOptions,),
    data_kinds=(DataKind(RETIRE, None, required=False), DataKind(SHRINK, None, required=False)),
    handlers=(Handler(JoinRun, on_control=hand_over), Handler(LeaveRun, on_control=hand_over)),
    run_drivers={OpenRunOptions: drive},
)
