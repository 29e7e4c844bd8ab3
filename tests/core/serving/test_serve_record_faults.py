"""A served request's record is finished even when closing its events window fails: the store's
thread runs it and nobody reads its result, so a failure there left the run "running" silently.

Real agent processes serve one request into a real workspace whose ``close_window`` fails as SQLite
does when the disk errors (an ``OperationalError`` the store's retry does not retry)."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading

from core import formats
from core.devices.local_cluster import LocalCluster
from core.planning.plan import ShardPlan
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings
from core.runs.run_tokenizer import load_tokenizer
from core.serving import Defaults, ServedModel, ServeSettings
from core.serving.openai_api import parse_request
from core.serving.served import Failed, Finished
from core.sessions.store import SessionStore
from tests.core.serving.conftest import DEVICES, serve_files


class DiskErrorOnClose(SessionStore):
    """A real workspace whose window closes fail with SQLite's own disk error."""

    def close_window(self, *args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")


def test_a_request_whose_window_cannot_be_closed_still_finishes_its_run_and_logs_why(tmp_path, caplog):
    model, plan_path = serve_files(tmp_path)
    ended, outcome = threading.Semaphore(0), []
    with DiskErrorOnClose(tmp_path / "ws.sqlite") as store, \
            LocalCluster(tmp_path / "cluster", DEVICES, threads_per_agent=1) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys, lease_s=10) as coordinator:
        session = store.create_session("served")
        served = ServedModel(coordinator, formats.load(plan_path, ShardPlan), str(model), "tiny-llama",
                             load_tokenizer(str(model)), ServeSettings(GenerationSettings(), max_tokens=4),
                             store=store, session_id=session)
        served.load()
        request = served.admit(parse_request(json.dumps({"model": "tiny-llama", "prompt": "the cat", "max_tokens": 4})
                                             .encode(), "completion", Defaults()),
                               lambda d: (outcome.append(d), ended.release()) if isinstance(d, (Finished, Failed))
                               else None)
        with caplog.at_level(logging.ERROR, logger="core.serving"):
            served.start_batch([request])
            assert ended.acquire(timeout=120), "the request never ended"
            served.unload()  # waits for the recordings to close
        store.flush()
        [run] = store.runs(session)
    # the status its end gave it (under heavy load a lost lease can fail the request), never left "running"
    assert run.status == ("completed" if isinstance(outcome[0], Finished) else "failed")
    assert f"closing request {request.id}'s events window failed" in caplog.text
