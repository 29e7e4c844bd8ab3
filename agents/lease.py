"""The agent's one-work-at-a-time rule and its run lease (the ``Agent``'s part that decides).

An agent serves one coordinator's work at a time: a run (or a technique's held session that takes
the run, ``Handler.takes_run``) is leased to the coordinator that started it, renewed by anything
it sends (its pings); silent longer than the lease, the agent aborts the run. A request that would
need the worker while other work runs is refused at once, naming what the agent is busy with and
how that ends. Technique requests take part through their ``agents.registry.Handler`` flags.
"""

from __future__ import annotations

import os
import time

from agents import registry
from agents.protocol import AgentState, LoadShard, MeasureLink, ProfileCompute, RunError, StartRun, StopRun, Unload

LOADER_SILENT_S = 5.0
"""A loaded stage belongs to the coordinator that loaded it while that coordinator speaks (its link
pings every 0.5 s); silent this long, another coordinator's held session (a technique's
``Handler.replaces_stage``) may replace the stage (a CLI run that exited must not hold the device
forever)."""


class LeaseRules:
    """Mixed into ``agents.agent.Agent``: its state fields are the agent's own."""

    def _owner(self) -> bytes | None:
        """The coordinator whose work this agent does now: its run's or session's, else its stage's."""
        if self._state is AgentState.RUNNING:
            return self._run_owner
        if self._state is AgentState.LOADING or self._loaded is not None:
            return self._loader
        return None

    def owns(self, identity: bytes | None) -> bool:
        """Whether ``identity`` is the coordinator whose work this agent does now (a technique's
        diagnostic of its stage answers only that one)."""
        return identity is not None and identity == self._owner()

    def _silent_s(self, identity: bytes | None) -> float:
        heard = self._heard.get(identity) if identity is not None else None
        return 0.0 if heard is None else time.monotonic() - heard

    def _hear(self, identity: bytes) -> None:
        self._heard[identity] = time.monotonic()
        if len(self._heard) > 64:  # coordinators come and go: keep the ones heard last
            for old in sorted(self._heard, key=self._heard.get)[:32]:
                if old not in (self._loader, self._run_owner):
                    del self._heard[old]

    _EXCLUSIVE = (LoadShard, StartRun, ProfileCompute, MeasureLink)
    """Base requests that need the worker to themselves or start work of their own: one at a time
    (a technique's handler says so with ``Handler.exclusive``)."""

    def _refusal(self, identity: bytes, msg) -> str:
        """Why ``msg`` may not run now because the agent serves other work ("" when it may).

        One coordinator's work at a time: while a run or a technique's held session runs
        (or a stage loads) nothing else starts, and only its own coordinator unloads or stops it
        without naming it (a ``StopRun`` naming the run is honoured from anyone: the operator asked
        for that run). A stage another coordinator loaded and still speaks to is not replaced by a
        held session (``LOADER_SILENT_S``); layer-sharding loads replace stages as
        before. A refusal is immediate: queued behind the work, the request would hang until it ended."""
        state = self._state
        handler = registry.handler_for(type(msg))
        if state in (AgentState.RUNNING, AgentState.LOADING):
            owner = self._owner()
            foreign = owner is not None and owner != identity
            if isinstance(msg, self._EXCLUSIVE) or (handler is not None and handler.exclusive) \
                    or (foreign and isinstance(msg, Unload)):
                return self._busy_text(identity, msg)
            if (isinstance(msg, StopRun) and not msg.run_id and state is AgentState.RUNNING and foreign
                    and self._lease_holder is not None):
                return self._busy_text(identity, msg)
            return ""
        replaces = isinstance(msg, Unload) or (handler is not None and handler.replaces_stage)
        if (state is AgentState.READY and replaces
                and self._loader not in (None, identity) and self._silent_s(self._loader) < LOADER_SILENT_S):
            return self._busy_text(identity, msg)
        return ""

    def _doing(self) -> str:
        """What this agent serves, for an operator: the run or session, else the loaded stage."""
        cur, loaded = self._current, self._loaded
        if self._state is AgentState.LOADING:
            return "loading a stage"
        if self._state is AgentState.RUNNING:
            handler = registry.handler_for(type(cur)) if cur is not None else None
            if handler is not None and handler.describe is not None:
                return handler.describe(self, cur)
            if isinstance(cur, StartRun) and loaded is not None:
                return f"{loaded.msg.kind} run {cur.run_id} (units [{loaded.msg.start}, {loaded.msg.end}))"
            return "a run"
        if loaded is not None:
            m = loaded.msg
            return f"a loaded {m.kind} stage (units [{m.start}, {m.end}) of {os.path.basename(m.model_dir) or m.model_dir})"
        return "nothing"

    _WANTED = {"LoadShard": "load a stage", "StartRun": "start a run", "ProfileCompute": "profile",
               "MeasureLink": "measure a link", "Unload": "unload", "StopRun": "stop a run it did not name"}
    """What a refused base request wanted (a technique's handler says it with ``Handler.wanted``)."""

    def _busy_text(self, identity: bytes, msg) -> str:
        owner = self._owner()
        whose = "this coordinator" if owner == identity else "another coordinator"
        if self._state is AgentState.LOADING:
            ends = "try again once the load is done"
        elif self._state is AgentState.RUNNING and self._lease_holder is not None:
            ends = (f"it ends when {whose} stops it, or by itself {self._lease_s:g} s after that coordinator "
                    "goes silent")
        elif self._state is AgentState.RUNNING:
            ends = f"it ends when {whose} stops it"
        else:
            ends = (f"unload it from {whose}, or close that coordinator: once silent for {LOADER_SILENT_S:g} s "
                    "its stage may be replaced")
        handler = registry.handler_for(type(msg))
        wanted = handler.wanted if handler is not None and handler.wanted else None
        return (f"cannot {wanted or self._WANTED.get(type(msg).__name__, msg.type_name())}: busy with {self._doing()} "
                f"for {whose}; {ends}")

    def _take_run(self, identity: bytes, msg) -> None:
        """Start a run the sender holds a lease on: a fresh stop event (a late stop of the
        last run cannot reach it), the run id a ``StopRun`` is compared with, then the work."""
        self._state = AgentState.RUNNING
        self._run_owner, self._current = identity, msg
        self._stop_run = self._inbox.stop_event()  # setting it wakes the data receive (DataInbox)
        self._run_id = msg.run_id
        self._lease_holder = identity if msg.lease_s > 0 else None
        self._lease_s = msg.lease_s
        self._lease_renewed = time.monotonic()
        self._work.put(("StartRun" if isinstance(msg, StartRun) else "handler", msg, self._stop_run, identity))

    def _check_lease(self) -> None:
        """Abort a run whose coordinator went silent (killed, stopped, cut off): the agent
        must not stay "running" for a coordinator that will never stop it."""
        if self._lease_holder is None or self._state is not AgentState.RUNNING:
            return
        silent = time.monotonic() - self._lease_renewed
        if silent > self._lease_s and not self._stop_run.is_set():
            why = f"run lease expired (coordinator silent for {silent:.1f} s): run aborted"
            self._log(f"run {self._run_id}: {why}")
            holder, self._lease_holder = self._lease_holder, None
            self._stop_run.set()
            # a coordinator that was only stopped (SIGSTOP) learns on SIGCONT why its run ended
            self._send_to_coordinator(RunError(run_id=self._run_id, device=self.device, message=why), holder)

