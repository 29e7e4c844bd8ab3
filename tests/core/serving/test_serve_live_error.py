"""``edgeshard serve --on-failure replan`` when the open run ends through a live stage's error (it noticed its peer
gone before the heartbeats did): the server re-plans without every agent that is actually lost, not the device the
error names, and its in-flight requests resume with transformers' own tokens (as ``edgeshard run``'s recovery:
tests/core/runs/test_recovery.py). In-process agents, so a live one can report the loss of its peer."""

from __future__ import annotations

import json
import threading

from agents.agent import Agent
from agents.protocol import LinkShape, RunError
from agents.transport import CurveKeys
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator
from core.runs.generation import GenerationSettings
from core.runs.recovery import ExactReplanner
from core.runs.run_tokenizer import load_tokenizer
from core.serving import Defaults, ServedModel, ServeSettings
from core.serving.openai_api import parse_request
from core.serving.served import Failed, Finished, Piece
from tests.core.runs.test_recovery import _fitting_budget, _problem
from tests.core.serving.conftest import Reference, serve_files

PROMPTS = ["the river", "a cat sat on the", "once upon a time", "snow fell"]
SLOW = LinkShape(latency_ms=15)  # each hop: the decode lasts well past the loss


def test_a_run_ended_by_a_live_stages_error_is_replanned_without_the_agents_actually_lost(tmp_path):
    """c and d are closed mid-decode and b, alive, reports it lost its peer c long before a heartbeat runs out:
    the failure names b, yet the server re-plans on a and b (two devices' memory is needed), and every request
    completes with generate's greedy text."""
    model, _ = serve_files(tmp_path, chat_template=None, devices=["a"])
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b", "c", "d")}
    endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
    going, reported, ended = threading.Event(), threading.Event(), threading.Semaphore(0)
    still_heard: list[bool] = []
    outcomes: dict[int, object] = {}

    def lose_c_and_d() -> None:
        agents["c"].close()
        agents["d"].close()
        agents["b"].post(RunError(run_id=agents["b"].run_id, device="b", message="lost its peer c"))
        still_heard.append(not co.link.is_lost("c"))
        reported.set()

    def deliver_to(i: int):
        pieces = 0

        def deliver(d) -> None:
            nonlocal pieces
            if isinstance(d, Piece):
                pieces += 1
                if pieces == 3 and not going.is_set():  # the first stream with 3 pieces sets the loss going
                    going.set()
                    threading.Thread(target=lose_c_and_d, daemon=True).start()
            elif isinstance(d, (Finished, Failed)):
                outcomes[i] = d
                ended.release()
        return deliver

    try:
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=4.0) as co:
            two_needed = ExactReplanner(_problem(str(model), list(agents), memory_gib=_fitting_budget(str(model), 0.6)))
            served = ServedModel(co, plan_from_boundaries("tiny-llama", 6, list(agents), [2, 3, 4]), str(model),
                                 "tiny-llama", load_tokenizer(str(model)),
                                 ServeSettings(GenerationSettings(links={d: SLOW for d in agents})), replan=two_needed)
            served.load()
            try:
                requests = [served.admit(parse_request(json.dumps({"model": "tiny-llama", "prompt": p, "max_tokens": 24})
                                                       .encode(), "completion", Defaults()), deliver_to(i))
                            for i, p in enumerate(PROMPTS)]
                served.start_batch(requests[:2])
                served.start_batch(requests[2:])
                for _ in PROMPTS:
                    assert ended.acquire(timeout=120), "a request never ended"
                assert reported.is_set() and still_heard == [True]  # the heartbeats had not decided on c
                assert served.plan.devices() == ("a", "b")
                reference = Reference(model)
                assert [outcomes[i].__class__ for i in range(len(PROMPTS))] == [Finished] * len(PROMPTS), outcomes
                assert [r.text for r in requests] == [reference.complete(p, 24) for p in PROMPTS]
            finally:
                served.unload()
    finally:
        for a in agents.values():
            a.close()
