"""Placing a local cluster's agents and its coordinator on the host's cores: the decision (which
cores, for how many micro-batches in flight) and its application to every thread of real processes.
The host's cores are injected or read, never assumed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from agents.process_title import CONTROL_THREAD_NAME
from core.devices.cpu_placement import CpuPlacement, CpuPlacer, pin_process, place_on_cpus
from core.devices.local_cluster import LocalCluster


def _cores(*ids):
    return frozenset(ids)


def test_one_micro_batch_in_flight_puts_the_agents_on_one_core_and_the_coordinator_on_the_rest():
    got = place_on_cpus([0, 1], agents=3, threads_per_agent=1, computing_at_once=1)
    assert got == CpuPlacement(agents=_cores(0), coordinator=_cores(1)) and got.split


def test_an_idle_cluster_is_placed_as_for_one_micro_batch():
    assert place_on_cpus([0, 1], agents=3, threads_per_agent=1, computing_at_once=0) == \
        place_on_cpus([0, 1], agents=3, threads_per_agent=1, computing_at_once=1)


def test_micro_batches_that_need_every_core_share_every_core():
    got = place_on_cpus([0, 1], agents=3, threads_per_agent=1, computing_at_once=2)
    assert got == CpuPlacement(agents=_cores(0, 1), coordinator=_cores(0, 1)) and not got.split


def test_the_agents_get_their_threads_cores_for_each_micro_batch_in_flight_at_most_one_per_agent():
    assert place_on_cpus(range(16), agents=3, threads_per_agent=4, computing_at_once=1) == \
        CpuPlacement(agents=frozenset(range(4)), coordinator=frozenset(range(4, 16)))
    assert place_on_cpus(range(16), agents=3, threads_per_agent=4, computing_at_once=5) == \
        CpuPlacement(agents=frozenset(range(12)), coordinator=frozenset(range(12, 16)))


def test_a_single_core_or_no_agents_leaves_everything_on_every_core():
    assert not place_on_cpus([3], agents=2, threads_per_agent=1, computing_at_once=1).split
    assert not place_on_cpus([0, 1, 2], agents=0, threads_per_agent=1, computing_at_once=1).split


def test_the_cores_the_process_may_use_are_placed_whatever_their_numbers():
    assert place_on_cpus([7, 2, 5], agents=2, threads_per_agent=1, computing_at_once=1) == \
        CpuPlacement(agents=_cores(2), coordinator=_cores(5, 7))


def test_nonsense_counts_are_refused():
    for kwargs in ({"agents": -1, "threads_per_agent": 1, "computing_at_once": 1},
                   {"agents": 1, "threads_per_agent": 0, "computing_at_once": 1},
                   {"agents": 1, "threads_per_agent": 1, "computing_at_once": -1}):
        with pytest.raises(ValueError):
            place_on_cpus([0, 1], **kwargs)
    with pytest.raises(ValueError):
        place_on_cpus([], agents=1, threads_per_agent=1, computing_at_once=1)


THREADED_CHILD = ("import threading, time\n"
                  "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
                  "print('up', flush=True)\n"
                  "time.sleep(120)\n")


CONTROL_NAMED_CHILD = ("import threading, time\n"
                       "from agents.process_title import CONTROL_THREAD_NAME, name_this_thread\n"
                       "named = threading.Event()\n"
                       "def control():\n"
                       "    name_this_thread(CONTROL_THREAD_NAME)\n"
                       "    named.set()\n"
                       "    time.sleep(120)\n"
                       "threading.Thread(target=control, daemon=True).start()\n"
                       "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
                       "named.wait()\n"
                       "print('up', flush=True)\n"
                       "time.sleep(120)\n")


@pytest.fixture
def children():
    """Processes with a second thread each (what a placement pins), ended after the test; ``make(script)``
    runs another child script."""
    made = []

    def make(script: str = THREADED_CHILD) -> int:
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "up"
        made.append(p)
        return p.pid

    yield make
    for p in made:
        p.kill()
        p.wait()


def _thread_cores(pid: int) -> list[frozenset[int]]:
    """Each thread's allowed cores, as the kernel reports them in /proc (Cpus_allowed_list)."""
    return [cores for _, cores in _named_thread_cores(pid)]


def _named_thread_cores(pid: int) -> list[tuple[str, frozenset[int]]]:
    """Each thread's kernel name and allowed cores, from /proc (a thread that ends meanwhile is left out)."""
    out = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in status:
            if line.startswith("Cpus_allowed_list:"):
                cores = set()
                for part in line.split(":", 1)[1].strip().split(","):
                    lo, _, hi = part.partition("-")
                    cores.update(range(int(lo), int(hi or lo) + 1))
                out.append((name, frozenset(cores)))
    return out


def _two_cores() -> tuple[frozenset[int], frozenset[int]]:
    host = sorted(os.sched_getaffinity(0))
    if len(host) < 2:
        pytest.skip("telling two cores apart needs two cores this process may use")
    return frozenset(host[:1]), frozenset(host[1:])


def test_pinning_a_process_pins_every_one_of_its_threads(children):
    pid = children()
    first = frozenset({min(os.sched_getaffinity(0))})
    assert pin_process(pid, first) == (2, 0)
    assert _thread_cores(pid) == [first, first]


def test_the_placer_places_the_agents_it_is_told_now_and_the_coordinator(children):
    host = sorted(os.sched_getaffinity(0))
    agents, coordinator = [children(), children()], children()
    placer = CpuPlacer(lambda: agents, threads_per_agent=1, cpus=host, own_pid=coordinator)
    want = place_on_cpus(host, agents=2, threads_per_agent=1, computing_at_once=1)
    assert placer.place(1) == want
    assert all(_thread_cores(p) == [want.agents] * 2 for p in agents)
    assert _thread_cores(coordinator) == [want.coordinator] * 2
    agents[1] = children()  # an agent restarted (a recovery): a new process, placed though the decision is the same
    assert placer.place(1) == want
    assert _thread_cores(agents[1]) == [want.agents] * 2


def test_the_placer_follows_the_counts_it_is_told_on_its_own_thread(children):
    host = sorted(os.sched_getaffinity(0))
    agents, coordinator = [children(), children()], children()
    placer = CpuPlacer(lambda: agents, threads_per_agent=1, cpus=host, own_pid=coordinator)
    placer.place(1)
    wider = place_on_cpus(host, agents=2, threads_per_agent=1, computing_at_once=2)
    try:
        placer.on_busy(2)  # returns at once: the open run tells it on its IO thread and the event loop
        deadline = time.monotonic() + 30  # a bound on a hang, not a speed threshold
        while placer.placed != wider and time.monotonic() < deadline:
            time.sleep(0.01)
        assert placer.placed == wider
        assert all(_thread_cores(p) == [wider.agents] * 2 for p in agents)
        assert _thread_cores(coordinator) == [wider.coordinator] * 2
    finally:
        placer.close()
    assert not any(t.name == "edgeshard-cpu-placer" for t in threading.enumerate())


def test_cores_the_host_does_not_have_are_refused_and_counted_not_raised(children):
    pid = children()
    before = _thread_cores(pid)
    assert pin_process(pid, frozenset({4095})) == (0, 2)
    assert _thread_cores(pid) == before


def test_a_control_thread_named_by_its_agent_goes_on_the_other_cores_and_the_rest_stays(children):
    compute, other = _two_cores()
    pid = children(CONTROL_NAMED_CHILD)
    assert pin_process(pid, compute, other) == (3, 0)
    got = _named_thread_cores(pid)
    assert sorted(cores for name, cores in got if name == CONTROL_THREAD_NAME) == [other]
    assert sorted(cores for name, cores in got if name != CONTROL_THREAD_NAME) == [compute, compute]
    assert pin_process(pid, compute) == (3, 0)  # without other cores: every thread with the compute
    assert _thread_cores(pid) == [compute] * 3


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """Two real agents of a local cluster (no shard loaded: their threads are what is placed)."""
    with LocalCluster(tmp_path_factory.mktemp("placed"), ["edge-0", "edge-1"], threads_per_agent=1) as cluster:
        yield cluster


def test_the_placer_puts_real_agents_control_threads_with_the_coordinator_and_the_rest_on_the_agents_cores(
        agents, children):
    host = sorted(os.sched_getaffinity(0))
    _two_cores()
    coordinator = children()
    deadline = time.monotonic() + 30  # each agent's control thread names itself as it starts: a bound on a hang
    while not all(any(name == CONTROL_THREAD_NAME for name, _ in _named_thread_cores(p)) for p in agents.live_pids()):
        assert time.monotonic() < deadline, "an agent's control thread never named itself"
        time.sleep(0.01)
    placer = CpuPlacer(agents.live_pids, threads_per_agent=1, cpus=host, own_pid=coordinator)
    want = placer.place(1)
    assert want.split
    for pid in agents.live_pids():
        got = _named_thread_cores(pid)
        assert [cores for name, cores in got if name == CONTROL_THREAD_NAME] == [want.coordinator]
        rest = [cores for name, cores in got if name != CONTROL_THREAD_NAME]
        assert len(rest) >= 3 and set(rest) == {want.agents}  # main, worker, libzmq's IO thread among them
    assert _thread_cores(coordinator) == [want.coordinator] * 2
