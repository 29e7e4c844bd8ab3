"""Loading a plan's stages: taking agents over from a coordinator that died or hangs (its
lease), and waiting for every stage's load through the run state machine.

Why apart from ``core.runs.coordinator``: this is the plumbing under ``Coordinator.load``
(what a load asks of each agent is decided there); the waits here only read the link and
the agents' replies. ``run_failure`` is the one mapping of an unfinished run or load to
its typed error, shared by the load and the run.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

from agents.protocol import AgentState, AgentStatus, ErrorReply, GetStatus, StopRun
from core.devices.agent_link import AgentLink, holder_heard_between_polls
from core.errors import AgentBusy, DeviceUnavailable, RunFailed, ShardOverBudget
from core.reporting import Reporter
from core.runs import run_state


def take_over(link: AgentLink, statuses: dict[str, AgentStatus], timeout_s: float) -> None:
    """Free the plan's agents from runs this coordinator did not start, so a new coordinator can
    always take over agents whose coordinator died or hangs. A stop is answered after the run it
    ends, so they are ready to load when this returns. An agent refuses the stop (``busy``) while
    the run's coordinator holds its lease: then it is waited for — a silent coordinator's run ends
    by its lease — and one that still speaks is not ours to end (``AgentBusy`` names the run).
    Only while this coordinator runs nothing: then every running agent of the plan is another's."""
    orphans = [d for d, st in statuses.items() if st.state is AgentState.RUNNING]
    futs = [(d, link.request_async(d, StopRun())) for d in orphans]
    for d, f in futs:
        reply = link.await_reply(d, f, timeout_s, "ending a run of an earlier coordinator")
        if isinstance(reply, ErrorReply) and reply.code == "busy":
            await_lease(link, d, timeout_s)


def await_lease(link: AgentLink, device: str, timeout_s: float) -> None:
    """Wait until ``device`` no longer runs another coordinator's run (its lease runs out while
    that coordinator is silent); ``AgentBusy`` as soon as that coordinator is heard again."""
    deadline = time.monotonic() + timeout_s
    polled = None
    while True:
        st = link.status_of([device], 5.0)[device]
        now = time.monotonic()
        if st.state is not AgentState.RUNNING:
            return
        if holder_heard_between_polls(st.holder_silent_s, None if polled is None else now - polled) \
                or now > deadline:
            raise AgentBusy(f"busy with {st.activity or 'a run'} for another coordinator that is still "
                            "connected: stop it there, or wait for it to end", device)
        polled = now
        time.sleep(0.2)


def await_loads(link: AgentLink, futs: dict[str, cf.Future], timeout_s: float, reporter: Reporter) -> None:
    """Wait for every stage's load through the run state machine; report progress from the
    agents' statuses meanwhile (an agent answers ``get_status`` while it loads, with the
    fraction of blocks read)."""
    deadline = time.monotonic() + timeout_s
    state = run_state.begin(uuid.uuid4().hex[:12], tuple(futs), load=True)
    polls: dict[str, cf.Future] = {}
    while isinstance(state, run_state.Loading):
        pending = [d for d in state.stages if d not in state.loaded]
        cf.wait([futs[d] for d in pending], timeout=0.3, return_when=cf.FIRST_COMPLETED)
        for dev in pending:
            state = run_state.apply(state, load_outcome(link, dev, futs[dev]))
        if isinstance(state, run_state.Loading) and time.monotonic() > deadline:
            late = next(d for d in state.stages if d not in state.loaded)
            state = run_state.apply(state, run_state.StageRefused(
                late, f"no answer while loading its shard after {timeout_s:.0f} s", "no_answer"))
        if not isinstance(state, run_state.Loading):
            break
        for dev in (d for d in state.stages if d not in state.loaded):
            poll = polls.get(dev)
            if poll is not None and poll.done() and poll.exception() is None:
                st = poll.result()
                if isinstance(st, AgentStatus) and st.state is AgentState.LOADING:
                    state = run_state.apply(state, run_state.LoadProgress(dev, st.progress))
            if poll is None or poll.done():
                polls[dev] = link.request_async(dev, GetStatus())
        reporter.progress(state.done, state.total)
    if isinstance(state, run_state.Failed):
        let_loads_settle(link, futs, state.device, deadline)
        raise run_failure(state)
    reporter.progress(len(futs), len(futs))


def let_loads_settle(link: AgentLink, futs: dict[str, cf.Future], failed: str, deadline: float) -> None:
    """Wait until every other stage's load request has its answer, or its agent is lost, or the
    load's deadline: an agent still loading when the caller re-plans refuses the next load as busy
    (one stage refusing over its budget before reading anything overtook another's load)."""
    pending = [d for d, f in futs.items() if d != failed and not f.done()]
    while pending and time.monotonic() < deadline:
        cf.wait([futs[d] for d in pending], timeout=0.3, return_when=cf.FIRST_COMPLETED)
        pending = [d for d in pending if not futs[d].done() and not link.is_lost(d)]


def load_outcome(link: AgentLink, dev: str, fut: cf.Future) -> run_state.RunInput:
    """What one stage's load request says so far (a ``LoadProgress`` of 0 while it says nothing)."""
    if fut.done():
        err = fut.exception()
        if err is not None:  # a lost agent's future holds its RunFailed
            return run_state.StageRefused(dev, getattr(err, "reason", str(err)), "agent_lost")
        reply = fut.result()
        if isinstance(reply, ErrorReply):
            code = reply.code if reply.code in ("over_budget", "busy", "no_device") else "refused"
            return run_state.StageRefused(dev, f"cannot load its shard: {reply.message}", code)
        return run_state.StageLoaded(dev)
    if link.is_lost(dev):
        return run_state.StageRefused(dev, "agent lost while loading its shard", "agent_lost")
    return run_state.LoadProgress(dev, 0.0)



def run_failure(state: run_state.Failed | run_state.Aborted) -> RunFailed:
    """The typed error a run (or a load) that did not finish ends with."""
    if isinstance(state, run_state.Aborted):
        return RunFailed(state.reason)
    error = {"over_budget": ShardOverBudget, "busy": AgentBusy, "no_device": DeviceUnavailable}.get(state.code, RunFailed)
    return error(state.reason, state.device or None)
