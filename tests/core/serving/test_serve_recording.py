"""A served micro-batch's timeline events are stored once and shared by the runs of the requests in it,
and each request's replay still holds its micro-batch's events (as the agents streamed them, from its
join to its end, on its own clock) and its own tokens.

One micro-batch of 16 requests is served in this process over real agent processes into a real
workspace; what the agents streamed is taken from the served model's observer (the stream the
studio's live timeline reads), the independent reference for what was recorded."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest

from agents.protocol import TimelineEvent, TokenEvent
from core import formats
from core.devices.local_cluster import LocalCluster
from core.planning.plan import ShardPlan
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings
from core.runs.metrics import compute_figures, duration_s
from core.runs.run_tokenizer import load_tokenizer
from core.serving import Defaults, ServedModel, ServeSettings
from core.serving.openai_api import parse_request
from core.serving.served import Failed, Finished
from core.sessions.replay import Replay
from core.sessions.store import SessionStore
from tests.core.serving.conftest import DEVICES, serve_files

PROMPTS = ["the river ran", "a cat sat on", "once upon a time", "snow fell on the", "the king said to",
           "we went to the", "in the morning", "she looked at", "the old man", "far away there",
           "it was a dark", "he ran into", "my friend and", "under the bridge", "the ship sailed", "at the end"]


class Streamed:
    """What the open run streamed, as the studio's live view is told it (the coordinator's IO thread)."""

    def __init__(self) -> None:
        self.events: list[TimelineEvent] = []
        self.tokens: list[TokenEvent] = []

    def on_event(self, event: TimelineEvent) -> None:
        self.events.append(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        self.tokens.append(tokens)


@pytest.fixture(scope="module")
def served_batch(tmp_path_factory):
    """16 requests served as one micro-batch, recorded; yields (store, session id, requests, streamed, t0)."""
    folder = tmp_path_factory.mktemp("serve-recording")
    model, plan_path = serve_files(folder)
    plan = formats.load(plan_path, ShardPlan)
    ended = threading.Semaphore(0)
    store = SessionStore(folder / "ws.sqlite")
    try:
        with LocalCluster(folder / "cluster", DEVICES, threads_per_agent=1) as cluster, \
                Coordinator(cluster.endpoints, cluster.keys, lease_s=10) as coordinator:
            session = store.create_session("served batch")
            served = ServedModel(coordinator, plan, str(model), "tiny-llama", load_tokenizer(str(model)),
                                 ServeSettings(GenerationSettings(mode="no-bubbles"), max_tokens=6),
                                 store=store, session_id=session)
            served.load()
            streamed = served.observer = Streamed()
            requests = [served.admit(parse_request(json.dumps({"model": "tiny-llama", "prompt": p, "max_tokens": 6})
                                                   .encode(), "completion", Defaults()),
                                     lambda d: ended.release() if isinstance(d, (Finished, Failed)) else None)
                        for p in PROMPTS]
            served.start_batch(requests)
            for _ in requests:
                assert ended.acquire(timeout=120), "a request never ended"
            t0 = served.open.t0
            served.unload()  # waits for the recordings to close
            store.flush()
            yield store, session, requests, streamed, t0
    finally:
        store.close()


def _run_of(store: SessionStore, session: int, request) -> int:
    return next(r.id for r in store.runs(session) if r.settings["request_id"] == request.id)


def test_a_micro_batchs_events_are_stored_once_for_all_the_requests_in_it(served_batch):
    store, session, requests, streamed, _ = served_batch
    runs = store.runs(session)
    assert len(runs) == 16 and all(r.status == "completed" for r in runs)
    ids = ",".join(str(r.id) for r in runs)
    conn = store.db.conn
    copies = conn.execute(f"SELECT COUNT(*) FROM events WHERE run_id IN ({ids})").fetchone()[0]
    shared = conn.execute("SELECT COUNT(*) FROM stream_events").fetchone()[0]
    held = [len(store.events(r.id)) for r in runs]
    assert copies == 0 and shared == len(streamed.events) > 0  # each event the agents streamed: one row
    assert sum(held) >= 8 * shared  # which the 16 runs share (each holds those from its join to its end)


def test_each_requests_replay_is_its_micro_batchs_streamed_events_from_its_join_and_its_own_tokens(served_batch):
    store, session, requests, streamed, t0 = served_batch
    for r in requests:
        items = list(Replay.from_store(store, _run_of(store, session, r), speed=1e9).play())
        mine = [t for t in streamed.tokens if r.sequence_id in t.sequence_ids]
        micro_batch = mine[0].micro_batch
        shift = t0 - r.joined_at  # its clock starts at its join
        expected = [msgspec.structs.replace(e, micro_batch=0, start_s=e.start_s + shift, end_s=e.end_s + shift)
                    for e in streamed.events if e.micro_batch == micro_batch
                    and r.joined_at - 0.001 <= t0 + e.start_s <= r.ended_at]
        assert expected and [i.event for i in items if i.event is not None] == expected
        assert [i.tokens.token_ids[0] for i in items if i.tokens is not None] == \
            [t.token_ids[t.sequence_ids.index(r.sequence_id)] for t in mine]
        assert "".join(i.tokens.text[0] for i in items if i.tokens is not None) == r.text
        arrivals = [i.recv_s for i in items]
        assert arrivals == sorted(arrivals)


def test_each_requests_recorded_figures_are_those_of_its_stored_timeline(served_batch):
    """Its figures are computed from what the server kept (not read back): the token figures equal those of
    its stored tokens; its events (some may arrive after its record closed) span at least what it counted."""
    store, session, requests, _, _ = served_batch
    for r in requests:
        run = store.run(_run_of(store, session, r))
        events, tokens = store.events(run.id), store.tokens(run.id)
        stored = msgspec.to_builtins(compute_figures(events, tokens))
        keys = ("ttft_s", "per_token_latency_s", "decode_tokens_per_s", "tokens_per_s", "tokens")
        assert {k: run.figures[k] for k in keys} == {k: stored[k] for k in keys} and stored["tokens"] == len(r.tokens)
        assert 0 < run.figures["duration_s"] <= duration_s(events, tokens)
