"""What the server keeps of an open run's events gives a request's window the events the workspace gives
it back (``SessionStore.timeline``, a real SQLite file: the independent reference), so the figures a
request's record is finished with are those of its stored timeline; and what no open window needs is dropped."""

from __future__ import annotations

from agents.protocol import TimelineEvent
from core.serving.request_records import KEEP_S, KeptEvents
from core.sessions.store import SessionStore


def _events(n: int) -> list[TimelineEvent]:
    kinds = ("compute", "send", "recv_wait")
    return [TimelineEvent(device=f"edge-{i % 3}", stage=i % 3, kind=kinds[i % 3], phase="decode", step=i // 3,
                          micro_batch=i % 2, start_s=0.01 * i + 0.003 * (i % 4), end_s=0.01 * i + 0.008,
                          nbytes=64 * (i % 3 == 1), peer="edge-1" if i % 3 == 1 else "", clock_uncertainty_s=1e-4)
            for i in range(n)]


def test_a_requests_kept_window_is_what_the_workspace_gives_its_run_back(tmp_path):
    with SessionStore(tmp_path / "ws.sqlite") as store:
        session = store.create_session("served")
        run = store.create_run(session, model="m", mode="no-bubbles", settings={})
        stream, kept = store.create_event_stream(session), KeptEvents()
        kept.need("request", 1, 0.1)
        for seq, e in enumerate(_events(90)):
            recv = 0.05 + 0.004 * seq
            store.append_stream_event(stream, seq, recv, e)
            kept.add(recv, [e])
        window = store.open_window(run, stream, 1, from_s=0.1, shift_s=-0.12, recv_shift_s=0.3)
        store.close_window(window, 0.6)
        store.flush()
        stored = [(i.recv_s, i.event) for i in store.timeline(run)]
        assert stored and kept.window(1, 0.1, 0.6, -0.12, 0.3) == stored


def test_events_no_open_window_needs_are_dropped_once_a_window_is_counted():
    kept, events = KeptEvents(), _events(90)
    kept.need("early", 0, 0.1)
    kept.need("late", 0, 0.5)
    for seq, e in enumerate(events):
        kept.add(0.004 * seq, [e])
    kept.done("early", now_s=10.0)  # the late window still gets every event of its own
    late = [e for e in events if e.micro_batch == 0 and e.start_s >= 0.5]
    assert [e.start_s for _, e in kept.window(0, 0.5, None, 0.0, 0.0)] == [e.start_s for e in late]
    assert [e.start_s for _, e in kept.window(0, 0.0, None, 0.0, 0.0)] == [e.start_s for e in late]
    kept.done("late", now_s=0.7 + KEEP_S)  # none open: only the last KEEP_S stay (a window yet to open)
    assert [e.start_s for _, e in kept.window(0, 0.0, None, 0.0, 0.0)] == \
        [e.start_s for e in late if e.start_s >= 0.7]
