"""Open runs whose joins wait for their turn (sequential mode) on real agent processes: a join whose
every row leaves before its prefill is dropped on every stage, so the next join of its index samples
by its own sampling (it sampled by the dropped join's: a greedy request got another's seeded draws)."""

from __future__ import annotations

import pytest

from agents.protocol import SamplingSpec
from core.devices.local_cluster import LocalCluster
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings, load_plan
from core.runs.open_run import OpenRun
from tests.core.runs.test_open_run import Tokens
from tests.core.serving.conftest import serve_files

DEVICES = ["ow-0", "ow-1"]
"""Two stages: the source takes handed joins and leaves between steps (a one-stage source runs its steps
back to back, so a join there starts once the running micro-batch is done)."""


@pytest.fixture(scope="module")
def waiting_run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from core import formats
    from core.planning.plan import ShardPlan

    folder = tmp_path_factory.mktemp("open-run-waiting")
    model, plan_path = serve_files(folder, devices=DEVICES, chat_template=None)
    plan = formats.load(plan_path, ShardPlan)
    reference = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    with LocalCluster(folder / "cluster", DEVICES) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as coord:
        load_plan(coord, plan, str(model), GenerationSettings(threads=1))
        sink = Tokens()
        run = OpenRun(coord, plan, sink, slots=3, mode="sequential", eos_token_ids=(), pad_token_id=0)
        run.start()
        try:
            yield run, sink, reference
        finally:
            run.close()


def greedy(model, ids: list[int], n: int) -> list[int]:
    """A plain torch forward's argmax, token by token (no EOS: the run has none, so slot 0 cannot end early)."""
    import torch

    x, out = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=x).logits[0, -1].argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_a_join_left_before_its_prefill_does_not_sample_the_next_join_of_its_index(waiting_run):
    run, sink, reference = waiting_run
    (running,) = run.join(0, [[5, 17, 99, 3, 42, 8]], [200], SamplingSpec())
    sink.wait([running], [2])  # slot 0 decodes: slot 1 waits for it to finish (sequential)
    (gone,) = run.join(1, [[9, 8, 7]], [8], SamplingSpec(temperature=1.5, seed=7))
    run.leave([gone])  # handed after its join: it leaves before its prefill
    run.release(1)
    run.leave([running])  # slot 0 ends early, so the next join of slot 1 starts
    prompt = [7, 300, 12]
    (again,) = run.join(1, [prompt], [10], SamplingSpec())
    (got,) = sink.wait([again], [10], timeout_s=120)  # a bound on a hang, not a speed threshold
    run.release(0)
    run.release(1)
    assert gone not in sink.by_seq  # it never ran: the case this test is about
    assert got == greedy(reference, prompt, 10)
