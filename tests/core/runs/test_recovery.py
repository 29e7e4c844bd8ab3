"""A run survives a device killed mid-decode: re-planned over the survivors with the exact
solver, reloaded, resumed from prompt + tokens so far, with the undisturbed run's tokens."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from agents.agent import Agent
from agents.protocol import LinkShape, SamplingSpec, TimelineEvent, TokenEvent
from agents.transport import CurveKeys
from core.devices.local_cluster import LocalCluster
from core.models.checkpoints import ModelRecipe, make_model
from core.models.units import load_model_spec
from core.planning.plan import plan_from_boundaries
from core.planning.problem import Workload
from core.planning.scenarios import DeviceSpec, synthetic_problem
from core.runs import run_state
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest
from core.runs.recovery import ExactReplanner, RecoveryImpossible
from core.runs.wire import segments_stage_bytes, sent_between, snapshot

PROMPTS = ((5, 17, 33, 9, 101, 250), (0, 0, 7, 8, 9, 10))
MASKS = ((1,) * 6, (0, 0, 1, 1, 1, 1))
SLOW = LinkShape(latency_ms=15)  # each hop: the decode lasts well past the detection


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=13)
    return str(make_model(recipe, tmp_path_factory.mktemp("recovery") / "tiny-llama"))


def _problem(model_dir: str, devices: list[str], memory_gib: float = 1.0):
    spec = load_model_spec(model_dir, "fp32", name="tiny-llama")
    specs = [DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=memory_gib) for d in devices]
    return synthetic_problem(specs, spec, workload=Workload(prompt_tokens=6, generated_tokens=40, batch_size=2))


def _request(mode: str, sampling: SamplingSpec, max_new_tokens: int = 40) -> RunRequest:
    return RunRequest(input_ids=PROMPTS, attention_mask=MASKS, max_new_tokens=max_new_tokens, mode=mode,
                      micro_batches=2, eos_token_ids=(), pad_token_id=0, sampling=sampling)


class _KillAt:
    """A sink that kills ``device``'s agent process (SIGKILL) once decode step ``step`` is back."""

    def __init__(self, pid: int, step: int) -> None:
        self.pid, self.step = pid, step
        self.killed = threading.Event()
        self.events: list[TimelineEvent] = []

    def on_event(self, event: TimelineEvent) -> None:
        self.events.append(event)

    def on_tokens(self, tokens: TokenEvent) -> None:
        if tokens.step >= self.step and not self.killed.is_set():
            self.killed.set()
            os.kill(self.pid, signal.SIGKILL)


def test_killing_agents_mid_decode_recovers_with_the_undisturbed_tokens_greedy_and_seeded(model_dir, tmp_path):
    devices = ["a", "b", "c"]
    seeded = SamplingSpec(temperature=0.9, top_p=0.9, seed=7)
    with LocalCluster(tmp_path / "cluster", devices) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys, heartbeat_timeout_s=2.5) as co:
        plan = plan_from_boundaries("tiny-llama", 6, devices, [2, 4])
        links = {d: SLOW for d in devices}
        co.load(plan, model_dir, links=links)
        undisturbed = {name: co.run(plan, _request(mode, s)).tokens
                       for name, mode, s in (("greedy", "no-bubbles", SamplingSpec()), ("seeded", "bubbles", seeded))}
        # two devices' memory holds the model, one does not: the first re-plan must keep two stages
        two_needed = ExactReplanner(_problem(model_dir, devices, memory_gib=_fitting_budget(model_dir, 0.6)))

        kill_c = _KillAt(cluster.pid_of("c"), step=6)
        greedy = co.run(plan, _request("no-bubbles", SamplingSpec()), kill_c, replan=two_needed)
        assert kill_c.killed.is_set() and greedy.tokens == undisturbed["greedy"]
        (rec,) = greedy.recoveries
        assert rec.failed == "c" and rec.step >= 6 and "c" not in rec.new_stages and greedy.plan.devices() == rec.new_stages
        assert rec.detected_s < rec.replanned_s <= rec.loaded_s <= rec.resumed_s
        kinds = {e.kind for e in kill_c.events}
        assert {"failure", "replan", "reload"} <= kinds
        assert isinstance(co.latest_run_state, run_state.Finished)
        # what the re-planned stages' sockets sent after the re-plan is the re-planned plan's prediction, to the byte
        after = sent_between(rec.wire_at_resume, snapshot(co.status_of(list(rec.new_stages))))
        spec = load_model_spec(model_dir, "fp32")
        predicted = segments_stage_bytes(spec, plan, 6, greedy.token_events, greedy.run_id, greedy.recoveries)[-1]
        assert rec.resumed_width > 6 and predicted == {
            (src, dst): after.nbytes(senders=[src], links=[dst]) for src, dst in predicted}

        survivors = greedy.plan
        assert survivors.devices() == ("a", "b")
        victim = survivors.devices()[-1]
        kill_next = _KillAt(cluster.pid_of(victim), step=4)
        again = co.run(survivors, _request("bubbles", seeded), kill_next, replan=ExactReplanner(_problem(model_dir, devices)))
        assert kill_next.killed.is_set() and again.tokens == undisturbed["seeded"]
        assert again.plan.devices() == ("a",) and again.recoveries[0].failed == victim


def test_a_recovery_where_no_plan_fits_the_survivors_says_what_memory_is_missing(model_dir):
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b", "c")}
    try:
        # budgets so the model needs all three devices: two of them are short by a clear amount
        problem = _problem(model_dir, list(agents), memory_gib=_fitting_budget(model_dir, 0.45))
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as co:
            plan = plan_from_boundaries("tiny-llama", 6, ["a", "b", "c"], [2, 4])
            co.load(plan, model_dir, links={d: SLOW for d in agents})
            killer = _CloseAt(agents["c"], step=3)
            with pytest.raises(RecoveryImpossible) as info:
                co.run(plan, _request("sequential", SamplingSpec(), 60), killer, replan=ExactReplanner(problem))
            assert info.value.device == "c" and info.value.missing_bytes > 0
            assert "no plan fits the survivors (a, b)" in str(info.value) and "GiB missing" in str(info.value)
            state = co.latest_run_state
            assert isinstance(state, run_state.Failed) and state.code == "no_plan"
    finally:
        for a in agents.values():
            a.close()


def test_a_run_with_openais_penalties_resumes_counting_the_tokens_generated_before_the_failure(model_dir):
    """The resumed prefill's prompt ends with each sequence's tokens so far (``StartRun.first_steps``): the
    last stage counts them as generated, so the frequency and presence penalties go on as undisturbed."""
    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b")}
    penalised = SamplingSpec(frequency_penalty=0.75, presence_penalty=0.5)
    try:
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as co:
            plan = plan_from_boundaries("tiny-llama", 6, ["a", "b"], [3])
            co.load(plan, model_dir, links={d: SLOW for d in agents})
            undisturbed = co.run(plan, _request("no-bubbles", penalised, 24)).tokens
            assert undisturbed != co.run(plan, _request("no-bubbles", SamplingSpec(), 24)).tokens
            closer = _CloseAt(agents["b"], step=6)
            resumed = co.run(plan, _request("no-bubbles", penalised, 24), closer,
                             replan=ExactReplanner(_problem(model_dir, ["a", "b"])))
            assert closer.killed.is_set() and resumed.recoveries and resumed.plan.devices() == ("a",)
            assert resumed.tokens == undisturbed
    finally:
        for a in agents.values():
            a.close()


class _CloseAt(_KillAt):
    def __init__(self, agent: Agent, step: int) -> None:
        super().__init__(0, step)
        self.agent = agent

    def on_tokens(self, tokens: TokenEvent) -> None:
        if tokens.step >= self.step and not self.killed.is_set():
            self.killed.set()
            threading.Thread(target=self.agent.close, daemon=True).start()


def _fitting_budget(model_dir: str, share: float) -> float:
    """A per-device budget (GiB) holding ``share`` of the model (0.45: it needs all three devices)."""
    from core.errors import ModelDoesNotFit
    from core.planning.solvers import solve_min_latency

    with pytest.raises(ModelDoesNotFit) as info:  # next to no memory: (almost) the whole model is missing
        solve_min_latency(_problem(model_dir, ["a", "b", "c"], memory_gib=1e-12))
    return info.value.missing_bytes * share / 2**30


def _tok(mb, step, seqs, ids):
    return TokenEvent(micro_batch=mb, step=step, sequence_ids=seqs, token_ids=ids, t_s=0.0)


def test_the_resume_point_feeds_each_unfinished_micro_batch_its_tokens_so_far_and_keeps_its_sampler_key():
    from core.runs.recovery import resume_point

    ids = ((1, 2, 3), (0, 4, 5), (6, 7, 8))
    mask = ((1, 1, 1), (0, 1, 1), (1, 1, 1))
    groups = ((0, 1), (2,))
    tokens = [_tok(0, 0, (0, 1), (10, 2)), _tok(0, 1, (0, 1), (11, 12)), _tok(1, 0, (2,), (2,)),
              _tok(0, 3, (0, 1), (99, 99))]  # step 2 of micro-batch 0 never arrived: step 3 does not count
    r = resume_point(ids, mask, groups, tokens, max_new_tokens=5, eos_token_ids=(2,), pad_token_id=0)
    assert r.micro_batches == ((0, 1),) and r.keys == (0,) and r.first_steps == (2,)  # micro-batch 1 hit EOS
    assert r.generated == ((10, 11), (2,), (2,))
    assert r.input_ids[:2] == ((1, 2, 3, 10, 11), (0, 4, 5, 2, 0)) and r.attention_mask[1] == (0, 1, 1, 1, 1)
    assert r.input_ids[2] == (0, 0, 6, 7, 8) and r.attention_mask[2] == (0, 0, 1, 1, 1)


def test_a_run_ended_by_a_live_stages_error_replans_without_the_agent_that_is_actually_lost(model_dir):
    """c and d are closed mid-decode and b, alive, reports that it lost its peer c before any heartbeat runs
    out (60 s here): the failure names b, yet the re-plan leaves out c and d, the agents that do not answer
    (closed ports), and keeps b; two devices' memory is needed, so the survivors are a and b. Tokens:
    generate's."""
    import torch

    from agents.protocol import RunError
    from tests.core.hf_reference import hf_greedy_new_tokens

    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in ("a", "b", "c", "d")}
    try:
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=60.0) as co:
            plan = plan_from_boundaries("tiny-llama", 6, list(agents), [2, 3, 4])
            co.load(plan, model_dir, links={d: SLOW for d in agents})
            reported = threading.Event()

            class PeerLostAt(_KillAt):
                def on_tokens(self, tokens: TokenEvent) -> None:
                    if tokens.step >= 3 and not self.killed.is_set():
                        self.killed.set()
                        threading.Thread(target=self.lose_c, daemon=True).start()

                def lose_c(self) -> None:
                    agents["c"].close()
                    agents["d"].close()
                    agents["b"].post(RunError(run_id=agents["b"].run_id, device="b", message="lost its peer c"))
                    reported.set()

            two_needed = ExactReplanner(_problem(model_dir, list(agents), memory_gib=_fitting_budget(model_dir, 0.6)))
            result = co.run(plan, _request("no-bubbles", SamplingSpec(), 24), PeerLostAt(0, 3), replan=two_needed)
            assert reported.is_set() and not co.link.is_lost("c")  # the heartbeats had not decided
            (rec,) = result.recoveries
            assert (rec.failed, rec.also_lost) == ("c", ("d",)) and result.plan.devices() == ("a", "b")
            enc = {"input_ids": torch.tensor(PROMPTS), "attention_mask": torch.tensor(MASKS)}
            assert [tuple(t) for t in result.tokens] == [
                tuple(t) for t in hf_greedy_new_tokens(model_dir, enc, 24, eos_token_id=None)]
    finally:
        for a in agents.values():
            a.close()
