"""An agent killed (SIGKILL) mid-decode while `edgeshard serve` streams to 8 clients: with
``--on-failure replan`` every stream completes with the undisturbed tokens; without it the
affected requests end with 503, the server stays up, and serves again once the agent is back
(restarted on its address: the plan is loaded again for the next request)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from core import formats
from core.devices.local_cluster import LocalCluster
from core.sessions.store import SessionStore

from tests.core.serving.conftest import API_KEY, Reference, replan_problem, serve_files, start_server

PROMPTS = ["the river", "a cat sat on the", "once upon a time", "snow fell", "the king said", "we went to",
           "in the morning", "she looked at"]
THREE = ["edge-0", "edge-1", "edge-2"]
MIXED = {1: {"temperature": 0.9, "top_p": 0.95, "seed": 3}, 3: {"extra_body": {"repetition_penalty": 1.3}},
         5: {"temperature": 0.8, "seed": 4, "extra_body": {"repetition_penalty": 1.2}},
         6: {"frequency_penalty": 0.75, "presence_penalty": 0.5},
         7: {"temperature": 0.9, "seed": 5, "presence_penalty": 1.0, "logit_bias": {"7": 1.5}}}
"""Streams that sample or penalise (by index): each joins alone, as rows beside the greedy ones. OpenAI's
penalties count a resumed request's tokens before the failure as generated (``first_step``)."""
DECODE_PACE_MS = 25
"""Each stage's emulated data-link latency: a decode step takes at least a hop per stage, so 40 steps take >= 2 s.
Unpaced, the tiny model decoded every stream's tokens in ~0.12 s (335 tokens/s), before a loaded host's client had
read 3 pieces of one: the SIGKILL landed after the last token, with no request to recover (at load 13 and at 23)."""


def _streams_with_a_kill(client, pid: int, max_tokens: int, controls: dict[int, dict] | None = None) -> list:
    """8 concurrent streams (``controls``: a stream's sampling, greedy otherwise); SIGKILL ``pid`` once one
    has 3 pieces. Each: its text, or its APIError."""
    going = threading.Event()

    def stream(i: int):
        text, n = "", 0
        try:
            for c in client.completions.create(model="tiny-llama", prompt=PROMPTS[i], max_tokens=max_tokens,
                                               stream=True, **(controls or {}).get(i, {})):
                text += c.choices[0].text
                n += 1
                if n == 3:
                    going.set()
            return text
        except openai.APIError as err:
            return err

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(PROMPTS))]
        assert going.wait(120), "no stream got going"
        os.kill(pid, signal.SIGKILL)
        return [f.result(180) for f in futures]


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_with_replan_every_stream_completes_with_the_undisturbed_tokens(tmp_path):
    model, plan = serve_files(tmp_path, devices=THREE)
    problem = replan_problem(model, THREE, generated_tokens=40, batch_size=8)
    formats.save(tmp_path / "problem.json", problem)
    with LocalCluster(tmp_path / "cluster", THREE, threads_per_agent=1, link_latency_ms=DECODE_PACE_MS) as cluster:
        server = start_server(tmp_path, model, plan, "--on-failure", "replan", "--problem",
                              str(tmp_path / "problem.json"), "--batch-window-ms", "300",
                              agents=cluster.agents_file)
        try:
            client = _client(server)
            outcomes = _streams_with_a_kill(client, cluster.pid_of("edge-2"), 40, MIXED)
            reference = Reference(model)
            assert [o for i, o in enumerate(outcomes) if i not in MIXED] == \
                [reference.complete(p, 40) for i, p in enumerate(PROMPTS) if i not in MIXED]
            alone = {i: client.completions.create(model="tiny-llama", prompt=PROMPTS[i], max_tokens=40, **c)
                     .choices[0].text for i, c in MIXED.items()}  # each alone on the recovered plan
            assert {i: outcomes[i] for i in MIXED} == alone  # each row resumed with its own sampling and step
            with SessionStore(server.workspace) as store:  # the recovery is on the requests' recorded timelines
                timelines = [store.events(run.id) for run in store.runs()]
            assert {"failure", "replan", "reload"} <= {e.kind for events in timelines for e in events}
            for events in timelines:  # and a resumed request's timeline goes on with the new plan's run
                reloaded = max((e.end_s for e in events if e.kind == "reload"), default=None)
                assert reloaded is None or any(e.kind == "compute" and e.start_s >= reloaded for e in events)
        finally:
            assert server.stop() == 0


@pytest.mark.slow
def test_without_replan_the_affected_requests_get_503_and_the_server_serves_again_once_the_agent_is_back(
        tmp_path):
    model, plan = serve_files(tmp_path, devices=THREE[:2])
    with LocalCluster(tmp_path / "cluster", THREE[:2], threads_per_agent=1, link_latency_ms=DECODE_PACE_MS) as cluster:
        server = start_server(tmp_path, model, plan, "--batch-window-ms", "300", agents=cluster.agents_file)
        client = _client(server)
        try:
            outcomes = _streams_with_a_kill(client, cluster.pid_of("edge-1"), 120)
            assert all(isinstance(o, openai.APIError) and "cluster is unavailable" in str(o) for o in outcomes), \
                outcomes
            with pytest.raises(openai.APIStatusError) as err:  # the agent is still gone
                client.completions.create(model="tiny-llama", prompt="snow", max_tokens=4)
            assert err.value.status_code == 503
            cluster.restart("edge-1")
            deadline = time.monotonic() + 60
            while True:
                try:
                    r = client.completions.create(model="tiny-llama", prompt="the river", max_tokens=6)
                    break
                except openai.APIStatusError as e:
                    assert e.status_code == 503 and time.monotonic() < deadline
                    time.sleep(0.5)
            assert r.choices[0].text == Reference(model).complete("the river", 6)
        finally:
            assert server.stop() == 0
