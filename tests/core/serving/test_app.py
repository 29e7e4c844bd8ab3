"""The HTTP side's streams through the real app and uvicorn: a stream's headers go out once its request
joined the run (while its prefill runs), and a client that leaves before its first token cancels it. The
cluster's side is a queue whose run the test drives (``ServedRequest.joined``/``take``, as the coordinator's
threads call them), so what is checked is ordering, not timing."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from core.runs.generation import GenerationSettings, load_tokenizer
from core.serving import BatchQueue, Defaults, HttpServer, ServedModel, ServeSettings, bind, build_app

from tests.core.serving.conftest import serve_files

BODY = json.dumps({"model": "tiny-llama", "prompt": "the river", "max_tokens": 3, "temperature": 0,
                   "stream": True}).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from core import formats
    from core.planning.plan import ShardPlan

    model, plan = serve_files(tmp_path_factory.mktemp("app"), chat_template=None)
    return ServedModel(None, formats.load(plan, ShardPlan), str(model), "tiny-llama", load_tokenizer(str(model)),
                       ServeSettings(GenerationSettings(), max_tokens=8))


class HeldRun:
    """A run that says each request joined, then holds its tokens until the test releases them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.requests: list = []

    def __call__(self, batch) -> None:
        for r in batch:
            self.requests.append(r)
            r.joined()
        if self.release.wait(30):
            for r in batch:
                for token in (40, 41, 42):
                    r.take(token)


@pytest.fixture
def endpoint(served):
    run = HeldRun()
    queue = BatchQueue(run, max_waiting=4, max_batch=1, on_cancel_running=lambda r: None)
    server = HttpServer(build_app(served, queue, defaults=Defaults()), bind("127.0.0.1", 0))
    server.start()
    yield run, server.port
    run.release.set()
    queue.close()
    server.stop()


def _until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_streams_headers_arrive_once_it_joined_before_its_first_token(endpoint, served):
    run, port = endpoint
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
    resp = conn.getresponse()  # blocks until the headers: before, they waited for the first token
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert not run.release.is_set() and run.requests[0].tokens == []
    run.release.set()  # its three tokens come at once: they go out together (one write), each its own event
    events = [line[6:] for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    conn.close()
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == served.tokenizer.decode([40, 41, 42], skip_special_tokens=True)


def test_a_client_that_leaves_before_its_first_token_cancels_its_request(endpoint):
    run, port = endpoint
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.close()
    conn.close()  # gone while its prefill would run
    assert _until(lambda: run.requests[0].cancelled)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_streams_piece_events_are_its_chunks_byte_for_byte(kind):
    from core.serving.app import PieceEvents, _sse
    from core.serving.openai_api import chunk_body

    for model in ("tiny-llama", "odd \ue000 name"):  # the template's mark in a name: built chunk by chunk
        pieces = PieceEvents(kind, "cmpl-0123", model, 1700000000)
        for text in ("", " the", 'a "quoted" \\ line\n', "naïve 日本 🙂", "\ue000", "</s>\t\r"):
            assert pieces(text) == _sse(chunk_body(kind, "cmpl-0123", model, 1700000000, text=text))
