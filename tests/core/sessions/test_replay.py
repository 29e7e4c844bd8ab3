"""Replay: same items, same order, same figures as live; deterministic pacing, pause, seek, speed."""

from __future__ import annotations

import msgspec
import pytest

from agents.protocol import TimelineEvent, TokenEvent
from core.sessions.recording import RunRecorder
from core.sessions.replay import Replay
from core.runs.metrics import LiveMetrics
from core.runs.simulator import simulate
from core.sessions.store import RecordedItem, SessionStore
from tests.core.sessions_problems import make_plan, make_problem


class FakeClock:
    """A clock that only moves when something sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        self.now += dt


def _items(times: list[float]) -> list[RecordedItem]:
    out = []
    for i, t in enumerate(times):
        if i % 3 == 2:
            out.append(RecordedItem(seq=i, recv_s=t, tokens=TokenEvent(micro_batch=0, step=i // 3, sequence_ids=(0,),
                                                                       token_ids=(i,), t_s=t)))
        else:
            out.append(RecordedItem(seq=i, recv_s=t, event=TimelineEvent(
                device="a", stage=0, kind="compute", phase="decode", step=i // 3, micro_batch=0,
                start_s=max(0.0, t - 0.1), end_s=t)))
    return out


def test_play_yields_every_item_in_order_at_its_arrival_time_divided_by_the_speed():
    clock = FakeClock()
    items = _items([0.5, 1.0, 1.0, 2.0, 3.5, 4.0])
    replay = Replay(items, speed=10, clock=clock, sleep=clock.sleep, max_sleep_s=1.0)
    start = clock.now
    seen = [(it.seq, round(clock.now - start, 9)) for it in replay.play()]
    assert seen == [(0, 0.05), (1, 0.1), (2, 0.1), (3, 0.2), (4, 0.35), (5, 0.4)]
    assert replay.finished and replay.delivered() == items


def test_nothing_is_delivered_while_paused_and_resume_continues_where_it_stopped():
    clock = FakeClock()
    replay = Replay(_items([1.0, 2.0, 3.0]), clock=clock, sleep=clock.sleep)
    clock.now += 1.5
    assert [i.seq for i in replay.due()] == [0]
    replay.pause()
    clock.now += 10.0
    assert replay.due() == [] and replay.position_s == pytest.approx(1.5)
    replay.resume()
    clock.now += 0.5
    assert [i.seq for i in replay.due()] == [1]
    assert replay.position_s == pytest.approx(2.0)


def test_seek_forward_delivers_the_prefix_and_seek_back_rewinds_it():
    clock = FakeClock()
    replay = Replay(_items([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), clock=clock, sleep=clock.sleep, paused=True)
    replay.seek(3.5)
    assert [i.seq for i in replay.delivered()] == [0, 1, 2]
    replay.resume()
    clock.now += 1.0
    assert [i.seq for i in replay.due()] == [3]
    replay.seek(1.0)
    assert [i.seq for i in replay.delivered()] == [0]
    assert [i.seq for i in replay.play()] == [1, 2, 3, 4, 5]
    replay.seek(99.0)
    assert replay.finished and replay.position_s == 6.0


def test_a_speed_change_applies_from_the_current_position():
    clock = FakeClock()
    replay = Replay(_items([2.0, 4.0, 12.0]), speed=1.0, clock=clock, sleep=clock.sleep, max_sleep_s=0.5)
    it = replay.play()
    start = clock.now
    assert next(it).seq == 0 and clock.now - start == pytest.approx(2.0)
    replay.set_speed(4.0)
    assert next(it).seq == 1 and clock.now - start == pytest.approx(2.5)
    assert next(it).seq == 2 and clock.now - start == pytest.approx(4.5)
    with pytest.raises(ValueError):
        replay.set_speed(0)


def test_a_replay_of_a_recorded_run_reproduces_the_live_view_exactly(tmp_path):
    # "Live": a simulated run's events and tokens fed through a RunRecorder in arrival
    # order on a fake clock, with a LiveMetrics beside it as the GUI would have.
    p = make_problem({"a": 0.01, "b": 0.02, "c": 0.005}, generated_tokens=8)
    res = simulate(p, make_plan(p, ["a", "b", "c"], [3, 5], m=1, k=3), "no-bubbles")
    arrivals = sorted([(e.end_s, 0, e) for e in res.events] + [(t.t_s, 1, t) for t in res.tokens],
                      key=lambda x: (x[0], x[1]))
    clock = FakeClock()
    live = LiveMetrics()
    live_seen = []
    with SessionStore(tmp_path / "ws.sqlite") as store:
        rid = store.create_run(store.create_session("live"), model="m", mode="no-bubbles")
        rec = RunRecorder(store, rid, clock=clock)
        for at, kind, item in arrivals:
            clock.now = 100.0 + at
            if kind == 0:
                rec.on_event(item)
                live.add_event(item)
            else:
                rec.on_tokens(item)
                live.add_tokens(item)
            live_seen.append(item)
        rec.finish("completed")
        stored_figures = store.run(rid).figures
        rclock = FakeClock()
        replay = Replay.from_store(store, rid, speed=50, clock=rclock, sleep=rclock.sleep)
    replayed = LiveMetrics()
    replay_seen = []
    for item in replay.play():
        if item.event is not None:
            replayed.add_event(item.event)
        else:
            replayed.add_tokens(item.tokens)
        replay_seen.append(item.event or item.tokens)
    assert replay_seen == live_seen
    assert replayed.figures() == live.figures() == replay.figures()
    assert stored_figures == msgspec.to_builtins(live.figures())
    assert rclock.now - 100.0 == pytest.approx(res.figures.duration_s / 50, rel=1e-6)


def test_figures_after_a_seek_are_those_of_the_prefix_the_view_shows():
    items = _items([0.5, 1.0, 1.0, 2.0, 3.5, 4.0])
    replay = Replay(items, paused=True)
    replay.seek(2.0)
    figs = replay.figures()
    assert figs.tokens == 1 and figs.ttft_s == 1.0
