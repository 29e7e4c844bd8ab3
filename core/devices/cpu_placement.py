"""Which of the host's cores a local cluster's agents and its coordinator run on.

A local cluster (``--local``) runs every stage as a process on the host that also runs the server.
While one micro-batch is in flight the stages take turns: only one of them computes at a time, so
they need one stage's threads' worth of cores. Left to the scheduler, each hand-off from stage to
stage wakes the next agent on whichever core is idle (an idle virtual CPU takes 140-170 µs to wake
here, ``bench/serve_step_path.py``), and the server's burst of work for each step's tokens
interrupts a stage's forward. Put on one set of cores while the server has the others, the next
stage runs on the core the last one just left and no forward shares its core with the server: on
2 cores, 3 stages, 16 streaming clients, 0.60 -> 0.76 of transformers' batched ``generate`` (8
rotating rounds, load 2; docs/serving.md). With more micro-batches in flight the stages compute at
once and need the cores: then every process runs on every core again (48 clients on 2 cores: the
split gave 0.80 where sharing gave 0.92).

``place_on_cpus`` decides (pure); ``CpuPlacer`` applies a decision to the agents' processes and this
one, every thread of each (Linux keeps an affinity per thread), when the number in flight changes. An
agent's control thread (named ``agent-control`` by the agent) goes with the coordinator: the agents' core
is saturated at 16 streams, and its work waits on no forward (``OFF_COMPUTE_THREADS``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.process_title import CONTROL_THREAD_NAME

log = logging.getLogger(__name__)
OFF_COMPUTE_THREADS = frozenset({CONTROL_THREAD_NAME})
"""An agent's threads that go with the coordinator, not with the stage's compute: the control thread's work
(forwarding the step's tokens and events, heartbeats, joins) waits on no forward, and took ~3 % of the agents'
core at 16 streams on 3 stages. libzmq's IO thread stays: every hop's send and receive go through it."""


@dataclass(frozen=True)
class CpuPlacement:
    """The cores the agents may run on and those the coordinator (the server) may run on."""

    agents: frozenset[int]
    coordinator: frozenset[int]

    @property
    def split(self) -> bool:
        return self.agents != self.coordinator


def place_on_cpus(cpus: Sequence[int], *, agents: int, threads_per_agent: int,
                  computing_at_once: int) -> CpuPlacement:
    """Agents on the first cores ``computing_at_once`` of them need (at least one micro-batch's: an idle
    cluster is ready for its next request), the coordinator on the rest; everything on every core when
    that leaves the coordinator none, or with no agents."""
    if agents < 0 or threads_per_agent < 1 or computing_at_once < 0:
        raise ValueError("agents and micro-batches in flight must be >= 0 and threads per agent >= 1")
    ordered = sorted(set(cpus))
    if not ordered:
        raise ValueError("no cores to place on")
    need = max(1, min(computing_at_once, agents)) * threads_per_agent
    if agents == 0 or need >= len(ordered):
        everything = frozenset(ordered)
        return CpuPlacement(agents=everything, coordinator=everything)
    return CpuPlacement(agents=frozenset(ordered[:need]), coordinator=frozenset(ordered[need:]))


def pin_process(pid: int, cpus: frozenset[int], off_compute: frozenset[int] | None = None) -> tuple[int, int]:
    """Every thread of ``pid`` on ``cpus`` (those named ``OFF_COMPUTE_THREADS`` on ``off_compute`` when given),
    listed again until no new one appears (a thread started meanwhile by a thread not yet pinned would keep the
    old cores); (threads pinned, threads that refused: no permission, or cores the host does not have). A thread
    or process gone meanwhile is neither."""
    done: set[str] = set()
    refused = 0
    for _ in range(3):
        try:
            threads = set(os.listdir(f"/proc/{pid}/task")) - done
        except OSError:
            break
        if not threads:
            break
        for tid in threads:
            try:
                off = off_compute is not None and thread_name(pid, tid) in OFF_COMPUTE_THREADS
                os.sched_setaffinity(int(tid), off_compute if off else cpus)
            except ProcessLookupError:
                continue
            except OSError:
                refused += 1
            done.add(tid)
    return len(done) - refused, refused


def thread_name(pid: int, tid: int | str) -> str:
    """A thread's name for the kernel (its comm: the process name unless the thread set its own)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        raise ProcessLookupError(tid) from None


class CpuPlacer:
    """Applies ``place_on_cpus`` for the micro-batches in flight to the agents' processes (``agent_pids``:
    asked each time, so an agent restarted by a recovery is placed too) and to this process. Threads
    started later inherit their starter's cores. ``on_busy`` hands the count to the placer's own thread:
    the open run tells it on the coordinator's IO thread and the server's event loop, which must not wait
    for ~20 system calls (up to 3.7 ms at load 4.5, the calling thread among those moved). An idle server is
    placed as for one micro-batch, so the first request's stages are already placed; a second one in flight
    is placed a moment after its join goes out."""

    def __init__(self, agent_pids: Callable[[], Sequence[int]], threads_per_agent: int,
                 cpus: Sequence[int] | None = None, own_pid: int | None = None) -> None:
        self.cpus = tuple(sorted(os.sched_getaffinity(0) if cpus is None else cpus))
        self.agent_pids, self.threads_per_agent = agent_pids, threads_per_agent
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.placed: CpuPlacement | None = None
        self._placed_pids: tuple[int, ...] = ()
        self._refusal_logged = False
        self._lock = threading.Lock()
        self._wanted: int | None = None
        self._closed = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def place(self, computing_at_once: int) -> CpuPlacement:
        """Place for ``computing_at_once`` micro-batches in flight, now, on this thread (nothing is re-pinned when
        the decision and the agents are those in force)."""
        with self._lock:
            pids = tuple(p for p in self.agent_pids() if p)
            placement = place_on_cpus(self.cpus, agents=len(pids), threads_per_agent=self.threads_per_agent,
                                      computing_at_once=computing_at_once)
            if placement != self.placed or pids != self._placed_pids:
                refused = sum(pin_process(pid, placement.agents, placement.coordinator)[1] for pid in pids)
                refused += pin_process(self.own_pid, placement.coordinator)[1]
                if refused and not self._refusal_logged:
                    self._refusal_logged = True  # once: the server goes on unplaced, as any process would
                    log.warning("%d thread(s) could not be placed on cores %s: the host refuses to set their "
                                "affinity (serve --local-cpus shared leaves the cores to the scheduler)",
                                refused, sorted(placement.agents | placement.coordinator))
                self.placed, self._placed_pids = placement, pids
            return placement

    def on_busy(self, in_flight: int) -> None:
        """Hand ``in_flight`` to the placer's thread (started on the first call); the newest count wins."""
        with self._changed:
            if self._closed:
                return
            self._wanted = in_flight
            if self._thread is None:
                self._thread = threading.Thread(target=self._follow, name="edgeshard-cpu-placer", daemon=True)
                self._thread.start()
            self._changed.notify()

    def _follow(self) -> None:
        while True:
            with self._changed:
                while self._wanted is None and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                wanted, self._wanted = self._wanted, None
            try:
                self.place(wanted)
            except Exception:  # a placement is a speed-up only: the run goes on unplaced
                log.exception("placing the local agents on the host's cores failed")

    def close(self) -> None:
        """Stop following (the thread ends; the cores stay as last placed)."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
