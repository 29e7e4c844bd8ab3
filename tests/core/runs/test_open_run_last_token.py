"""An open run's first and last tokens of a request reach the coordinator at once, not after the source's next
step: a request that joins a running micro-batch (its TTFT) and one that ends while the micro-batch's other rows
go on (its client's end of stream, and a closed-loop client's next request) waited for that step. Real agents;
the source emulates a slow device, so that a step held back shows in the arrival times beside the host's own
delays (each passed 4 of 4 at load 6-8)."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from agents.emulation import DeviceEmulation
from agents.protocol import SamplingSpec
from core import formats
from core.devices.local_cluster import LocalCluster
from core.planning.plan import ShardPlan
from core.runs.coordinator import Coordinator, NullSink
from core.runs.generation import GenerationSettings, load_plan
from core.runs.open_run import OpenRun
from tests.core.serving.conftest import serve_files

DEVICES = ["lt-0", "lt-1"]
SLOWDOWN = 60.0
"""The source's compute takes this many times its CPU time (~50-60 ms a step here): a token held back for the
source's next step waits for that compute, or for its control thread's next flush (every 50 ms), tens of ms."""


class Arrivals(NullSink):
    """How long after the source got each step's tokens (``t_s``) the coordinator had them, and whose they were."""

    def __init__(self) -> None:
        self.delay: dict[int, float] = {}
        self.rows: dict[int, tuple[int, ...]] = {}
        self.lock = threading.Lock()

    def on_tokens(self, tokens) -> None:
        with self.lock:
            self.delay[tokens.step] = time.monotonic() - tokens.t_s
            self.rows[tokens.step] = tuple(tokens.sequence_ids)

    def wait_for_step(self, step: int) -> None:
        self._wait(lambda: True if step in self.delay else None,
                   lambda: f"step {step}'s tokens did not arrive (got steps {sorted(self.delay)})")

    def wait_for_seq(self, seq: int) -> int:
        """The step that brought sequence ``seq`` its first token, once it has arrived."""
        return self._wait(lambda: min((k for k, rows in self.rows.items() if seq in rows), default=None),
                          lambda: f"sequence {seq}'s first token did not arrive")

    def _wait(self, found, failure, timeout_s: float = 60.0):
        """``found()`` (read under the lock) once it is not None."""
        deadline = time.monotonic() + timeout_s  # a bound on a hang, not a speed threshold
        while time.monotonic() < deadline:
            with self.lock:
                got = found()
            if got is not None:
                return got
            time.sleep(0.005)
        raise AssertionError(failure())

    def lateness(self, steps) -> float:
        """The median delay of ``steps``' tokens, each over the delay of the step that reached the coordinator
        soonest (the two clocks' common offset)."""
        soonest = min(self.delay.values())
        return statistics.median(self.delay[k] - soonest for k in steps)


@pytest.fixture(scope="module")
def slow_source(tmp_path_factory):
    """A 2-stage plan over real agents whose source computes ``SLOWDOWN`` times slower: (coordinator, plan)."""
    folder = tmp_path_factory.mktemp("slow-source")
    model, plan_path = serve_files(folder, devices=DEVICES, chat_template=None)
    plan = formats.load(plan_path, ShardPlan)
    emulation = {DEVICES[0]: DeviceEmulation(compute_slowdown=SLOWDOWN), DEVICES[1]: DeviceEmulation()}
    with LocalCluster(folder / "cluster", DEVICES, emulation=emulation) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as coord:
        load_plan(coord, plan, str(model), GenerationSettings(threads=1))
        yield coord, plan


def test_the_last_token_of_a_row_that_ends_is_not_held_back_for_the_sources_next_step(slow_source):
    coord, plan = slow_source
    budgets = [3, 4, 5, 6, 7, 8, 9, 10, 20]  # no EOS: each row runs to its budget, one ends at each of steps 2-9
    prompts = [[5 + i, 17, 99 - i] for i in range(len(budgets))]
    sink = Arrivals()
    run = OpenRun(coord, plan, sink, slots=2, mode="no-bubbles", eos_token_ids=(), pad_token_id=0)
    run.start()
    try:
        run.join(0, prompts, budgets, SamplingSpec())
        sink.wait_for_step(budgets[-1] - 1)
    finally:
        run.close()
    ends = [b - 1 for b in budgets[:-1]]
    assert [len(sink.rows[k]) for k in ends] == list(range(len(budgets), 1, -1))  # one row ended at each
    # The source holds a step's tokens while it computes the next step (~SLOWDOWN × its CPU time here), unless
    # its control thread's periodic flush (every 50 ms) sends them first: held, they reach the coordinator a
    # few to ~50 ms later, on no schedule of theirs. A step where a row ended is sent at once. Compared by
    # medians over the 8 ends and the 10 held steps.
    held = [k for k in range(1, budgets[-1] - 1) if k not in ends]
    assert sink.lateness(ends) < sink.lateness(held) / 2, (sink.lateness(ends), sink.lateness(held))


def test_the_first_token_of_rows_that_join_a_running_micro_batch_is_not_held_back(slow_source):
    coord, plan = slow_source
    sink = Arrivals()
    run = OpenRun(coord, plan, sink, slots=2, mode="no-bubbles", eos_token_ids=(), pad_token_id=0)
    run.start()
    firsts = []
    try:
        (holder,) = run.join(0, [[5, 17, 99]], [60], SamplingSpec())  # runs past the test: no row ends in it
        sink.wait_for_step(2)
        for i in range(4):  # one at a time, each in a grown step of its own
            (seq,) = run.join(0, [[7 + i, 300, 12, 40 + i]], [60], SamplingSpec(), grow=True)
            firsts.append(sink.wait_for_seq(seq))
            sink.wait_for_step(firsts[-1] + 2)
        sink.wait_for_step(firsts[-1] + 6)
    finally:
        run.close()
    assert len(set(firsts)) == 4 and all(len(sink.rows[k]) == len(sink.rows[k - 1]) + 1 for k in firsts)
    # Each joined row's first token comes from a grown step, sent at once; the other steps (rows unchanged) are
    # held until the source's next compute or its control thread's 50 ms flush (as above).
    held = [k for k in range(1, firsts[-1] + 6) if k not in firsts and len(sink.rows[k]) == len(sink.rows[k - 1])]
    assert sink.lateness(firsts) < sink.lateness(held) / 2, (sink.lateness(firsts), sink.lateness(held))
