"""With ``--on-failure replan``, an agent of the plan lost while no request runs is re-planned around at the next
request: there was nothing to recover when it went, and that request was refused with 503 naming the lost agent
(the fault test met it under load: its SIGKILL landed after the cluster had produced every stream's tokens).

Real agent processes and the real re-planner; the order is gated, not timed: the next request comes only once the
coordinator has declared the agent lost and the open run's end has been handled (the plan no longer loaded)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from core import formats
from core.devices.local_cluster import LocalCluster
from core.planning.plan import ShardPlan
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings
from core.runs.recovery import ExactReplanner
from core.runs.run_tokenizer import load_tokenizer
from core.serving import Defaults, ServedModel, ServeSettings
from core.serving.openai_api import parse_request
from core.serving.served import Failed, Finished
from tests.core.serving.conftest import Reference, replan_problem, serve_files

THREE = ["edge-0", "edge-1", "edge-2"]


def _complete(served: ServedModel, prompt: str, max_tokens: int):
    """The request's text, or its ``Failed`` (the error its client would get)."""
    ended, outcome = threading.Event(), []

    def deliver(d) -> None:
        if isinstance(d, (Finished, Failed)):
            outcome.append(d)
            ended.set()
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens}).encode()
    request = served.admit(parse_request(body, "completion", Defaults()), deliver)
    served.start_batch([request])
    assert ended.wait(120), "the request never ended"
    return request.text if isinstance(outcome[0], Finished) else outcome[0]


def _until(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
def test_an_agent_lost_between_requests_is_replanned_around_at_the_next_request(tmp_path):
    model, plan_path = serve_files(tmp_path, devices=THREE)
    problem = replan_problem(model, THREE, generated_tokens=8, batch_size=1)
    with LocalCluster(tmp_path / "cluster", THREE, threads_per_agent=1) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys, lease_s=10) as coordinator:
        served = ServedModel(coordinator, formats.load(plan_path, ShardPlan), str(model), "tiny-llama",
                             load_tokenizer(str(model)), ServeSettings(GenerationSettings(), max_tokens=6),
                             replan=ExactReplanner(problem))
        served.load()
        try:
            reference = Reference(model)
            assert _complete(served, "the river", 6) == reference.complete("the river", 6)  # the open run is open
            os.kill(cluster.pid_of("edge-2"), signal.SIGKILL)  # no request in the run: nothing to recover now
            _until(lambda: coordinator.link.is_lost("edge-2") and not served.loaded,
                   "the loss of edge-2 never ended the open run")
            assert _complete(served, "snow fell", 6) == reference.complete("snow fell", 6)
            assert "edge-2" not in served.plan.devices()
        finally:
            served.unload()
