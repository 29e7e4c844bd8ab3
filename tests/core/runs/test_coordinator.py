"""A plan run over agents produces exactly the unpartitioned model's tokens in every mode,
and streams a complete, clock-corrected timeline while it runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import transformers  # noqa: F401  (imported once here: agents' worker threads import it concurrently)

from agents.agent import Agent, AgentClock
from agents.protocol import AgentState, SamplingSpec
from agents.transport import CurveKeys
from core.models.checkpoints import ModelRecipe, make_model
from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest, split_micro_batches
from core.errors import RunFailed
from core.runs.generation import GenerationSettings, generate, load_tokenizer
from core.planning.plan import plan_from_boundaries
from tests.core.hf_reference import hf_greedy_new_tokens, hf_seeded_new_tokens

DEVICES = ["src", "mid", "head"]
SKEW_S = 250.0
"""The "mid" agent's clock runs this far ahead of everyone else's."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=11)
    return str(make_model(recipe, tmp_path_factory.mktemp("coord") / "tiny-llama"))


class Recorder:
    def __init__(self):
        self.events, self.tokens = [], []
        self.arrivals: list[str] = []  # "event" / "tokens" in the order the sink got them

    def on_event(self, event):
        self.events.append(event)
        self.arrivals.append("event")

    def on_tokens(self, tokens):
        self.tokens.append(tokens)
        self.arrivals.append("tokens")


@pytest.fixture(scope="module")
def cluster(model_dir):
    keys = CurveKeys.generate()
    agents = []
    for d in DEVICES:
        a = Agent(d, keys.public)
        if d == "mid":
            base = AgentClock()
            a.clock = lambda base=base: base() + SKEW_S
        agents.append(a.start())
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 3])  # uneven: 2 | 1 | 3 units
    coordinator.load(plan, model_dir)
    coordinator.sync_clocks()
    yield coordinator, plan, agents
    coordinator.close()
    for a in agents:
        a.close()


PROMPTS = ["the cat sat", "a much longer prompt about the river and its banks", "hello", "one two three four"]


def _request(model_dir, mode, micro_batches=2, max_new_tokens=6, sampling=SamplingSpec(), prompts=PROMPTS):
    tok = load_tokenizer(model_dir)
    enc = tok(prompts, return_tensors="pt", padding=True)
    return enc, RunRequest(
        input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
        attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
        max_new_tokens=max_new_tokens, mode=mode, micro_batches=micro_batches,
        eos_token_ids=(2,), pad_token_id=0, sampling=sampling,
    )


@pytest.mark.parametrize("mode", ["sequential", "bubbles", "no-bubbles"])
def test_every_mode_generates_exactly_the_unpartitioned_models_tokens(cluster, model_dir, mode):
    coordinator, plan, _ = cluster
    enc, req = _request(model_dir, mode)
    result = coordinator.run(plan, req)
    assert list(result.tokens) == hf_greedy_new_tokens(model_dir, enc, req.max_new_tokens)


@pytest.mark.parametrize("mode", ["sequential", "no-bubbles"])
def test_greedy_with_a_repetition_penalty_and_an_ngram_ban_equals_hf_generate_over_three_stages(cluster, model_dir,
                                                                                              mode):
    """The last stage penalizes what each sequence holds, its padded prompt included, as HF does."""
    coordinator, plan, _ = cluster
    for penalty, ngram in ((1.3, 0), (1.2, 2)):
        sampling = SamplingSpec(repetition_penalty=penalty, no_repeat_ngram_size=ngram)
        enc, req = _request(model_dir, mode, max_new_tokens=12, sampling=sampling)
        result = coordinator.run(plan, req)
        expected = hf_greedy_new_tokens(model_dir, enc, req.max_new_tokens, repetition_penalty=penalty,
                                        no_repeat_ngram_size=ngram)
        assert list(result.tokens) == expected, (penalty, ngram)
    plain = hf_greedy_new_tokens(model_dir, enc, req.max_new_tokens)
    assert plain != expected  # the settings changed what greedy picks


def test_every_stage_reports_compute_send_and_wait_per_micro_batch_and_step_while_running(cluster, model_dir):
    coordinator, plan, _ = cluster
    _, req = _request(model_dir, "no-bubbles", micro_batches=2, max_new_tokens=5)
    sink = Recorder()
    result = coordinator.run(plan, req, sink)
    assert sink.events and len(sink.events) == len(result.events)
    steps = {(t.micro_batch, t.step) for t in result.token_events}
    for stage, device in enumerate(DEVICES):
        mine = [e for e in result.events if e.device == device]
        assert all(e.stage == stage for e in mine)
        computed = {(e.micro_batch, e.step) for e in mine if e.kind == "compute"}
        assert computed == steps, device
        sends = [e for e in mine if e.kind == "send"]
        assert {(e.micro_batch, e.step) for e in sends} == steps
        assert all(e.nbytes > 0 and e.peer == DEVICES[(stage + 1) % 3] for e in sends)
        assert any(e.kind == "recv_wait" for e in mine)
        assert all(e.end_s >= e.start_s for e in mine)
    # hidden states [B, T, 64] fp32 go stage to stage, token ids [B] int64 come back
    prefill_send = next(e for e in result.events if e.device == "src" and e.kind == "send" and e.step == 0)
    assert prefill_send.nbytes >= 2 * 64 * 4
    back = [e for e in result.events if e.device == "head" and e.kind == "send"]
    assert all(e.nbytes == 2 * 8 for e in back)
    # events arrived over the run, not in one lump at the end: between the tokens, whatever the
    # machine's speed or load (a time spread depends on both: a quick run fits in one flush)
    gaps_with_events = {sink.arrivals[:i].count("tokens") for i, a in enumerate(sink.arrivals) if a == "event"}
    assert len(gaps_with_events) >= 2, sink.arrivals


def test_events_of_an_agent_with_a_skewed_clock_land_on_the_coordinators_clock(cluster, model_dir):
    coordinator, plan, _ = cluster
    clocks = coordinator.clocks()
    # an estimate's promise: the true offset lies within its uncertainty (half the best probe's round
    # trip); how small that is follows the host's load, so it is bounded loosely
    assert abs(clocks["mid"].offset_s - SKEW_S) <= clocks["mid"].uncertainty_s + 1e-3
    assert abs(clocks["src"].offset_s) <= clocks["src"].uncertainty_s + 1e-3
    assert clocks["mid"].uncertainty_s < 0.5 and clocks["src"].uncertainty_s < 0.5
    _, req = _request(model_dir, "sequential", micro_batches=1, max_new_tokens=3)
    # heartbeats keep refining the estimates while the run goes on (every 0.5 s; a loaded host's run
    # outlasts that), so note every estimate an event was mapped with
    used: dict[str, set[float]] = {d: {c.uncertainty_s} for d, c in clocks.items()}
    clock_of = coordinator.link.clock_of

    def noting_clock_of(device):
        estimate = clock_of(device)
        if estimate is not None:
            used.setdefault(device, set()).add(estimate.uncertainty_s)
        return estimate

    coordinator.link.clock_of = noting_clock_of
    try:
        result = coordinator.run(plan, req)
    finally:
        del coordinator.link.clock_of

    def compute(device, step):
        return next(e for e in result.events if e.device == device and e.kind == "compute" and e.step == step)

    def slack(a, b):  # two corrected clocks may disagree by both estimates' uncertainties
        return max(used[a]) + max(used[b]) + 0.005

    for step in range(3):  # a skew of 250 s uncorrected would break this order by minutes
        assert compute("src", step).end_s <= compute("mid", step).start_s + slack("src", "mid")
        assert compute("mid", step).end_s <= compute("head", step).start_s + slack("mid", "head")
    assert all(-1.0 < e.start_s < result.wall_s + 1.0 for e in result.events)
    assert all(e.clock_uncertainty_s in used[e.device] for e in result.events)


def test_seeded_sampling_gives_the_same_tokens_in_every_mode_and_matches_the_reference(cluster, model_dir):
    coordinator, plan, _ = cluster
    spec = SamplingSpec(temperature=0.9, top_p=0.9, seed=5)
    enc, req = _request(model_dir, "sequential", micro_batches=1, max_new_tokens=6, sampling=spec)
    first = coordinator.run(plan, req).tokens
    for mode in ("bubbles", "no-bubbles"):
        assert coordinator.run(plan, _request(model_dir, mode, 1, 6, spec)[1]).tokens == first
    rows = tuple(range(enc["input_ids"].shape[0]))  # one micro-batch: one draw per step over every row
    expected = hf_seeded_new_tokens(model_dir, enc, 6, [rows], temperature=0.9, top_p=0.9, seed=5)
    assert [tuple(t) for t in first] == [tuple(t) for t in expected]


def test_text_in_text_out_streams_pieces_that_add_up_to_the_final_text(cluster, model_dir):
    coordinator, plan, _ = cluster
    sink = Recorder()
    out = generate(coordinator, plan, model_dir, PROMPTS[:2],
                   GenerationSettings(max_new_tokens=6, mode="bubbles", micro_batches=2), sink=sink, load=False)
    for seq, text in enumerate(out.texts):  # in the order the sink got them, as a screen shows them (t_s
        # is mapped with the clock estimate of the moment, which heartbeats refine between two tokens)
        pieces = "".join(t.text[t.sequence_ids.index(seq)] for t in sink.tokens if seq in t.sequence_ids)
        assert pieces == text
    # ttft 0: an offset estimate that placed the first token before the start (kept at the start)
    assert out.figures.ttft_s is not None and out.figures.ttft_s >= 0 and out.figures.tokens > 0


def test_stopping_from_another_thread_ends_the_run_and_leaves_agents_ready(cluster, model_dir):
    coordinator, plan, agents = cluster
    _, req = _request(model_dir, "no-bubbles", micro_batches=2, max_new_tokens=400)
    req = RunRequest(**{**req.__dict__, "eos_token_ids": ()})
    timer = threading.Timer(0.3, coordinator.stop)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match="stopped"):
        coordinator.run(plan, req)
    timer.join()
    assert time.monotonic() - t0 < 10
    assert {s.state for s in coordinator.status().values()} == {AgentState.READY}
    _, small = _request(model_dir, "sequential", 1, 2)
    assert len(coordinator.run(plan, small).tokens) == len(PROMPTS)


def test_micro_batches_split_sequences_evenly_in_order():
    assert split_micro_batches(5, 2) == ((0, 1, 2), (3, 4))
    assert split_micro_batches(2, 4) == ((0,), (1,))


def test_after_loading_each_agent_takes_data_only_from_the_other_stages_of_the_plan(cluster):
    _, _, agents = cluster
    keys = {a.device: a.keys.public for a in agents}
    outsider = CurveKeys.generate().public
    for a in agents:
        for device, key in keys.items():
            assert a.gate.callback("data", key.encode()) == (device != a.device)
        assert not a.gate.callback("data", outsider.encode())
        assert not a.gate.callback("control", keys[a.device].encode())


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2", "mixtral"])
def test_other_families_split_over_agents_also_generate_exactly(family, tmp_path):
    extra = {} if family == "gpt2" else {"kv_heads": 2}
    recipe = ModelRecipe(family=family, layers=2, hidden=64, heads=4, vocab=512, seed=2, **extra)
    model_dir = str(make_model(recipe, tmp_path / family))
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in ("a", "b")]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            plan = plan_from_boundaries(family, 4, ["a", "b"], [1])  # embedding | blocks + head
            co.load(plan, model_dir)
            enc, req = _request(model_dir, "no-bubbles", micro_batches=2, max_new_tokens=4, prompts=PROMPTS[:3])
            assert list(co.run(plan, req).tokens) == hf_greedy_new_tokens(model_dir, enc, 4)
    finally:
        for a in agents:
            a.close()


def test_garbage_on_a_data_socket_is_dropped_and_the_run_still_matches(cluster, model_dir):
    import zmq

    from agents.transport import curve_client

    coordinator, plan, agents = cluster
    src, mid = agents[0], agents[1]
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        curve_client(push, src.keys, mid.keys.public)  # a key the plan allows
        push.connect(mid.data_address)
        for frames in ([b"\xc1garbage"], [b"\x81\xa1v\x05", b"x"], [b"\x00" * 100, b"\x01"]):
            push.send_multipart(frames)
        enc, req = _request(model_dir, "no-bubbles")
        assert list(coordinator.run(plan, req).tokens) == hf_greedy_new_tokens(model_dir, enc, req.max_new_tokens)
        assert any("dropped data message" in line for line in coordinator.logs("mid"))
    finally:
        ctx.destroy(linger=0)


def test_a_second_run_while_one_is_in_progress_is_refused(cluster, model_dir):
    coordinator, plan, _ = cluster
    _, req = _request(model_dir, "no-bubbles", micro_batches=2, max_new_tokens=400)
    req = RunRequest(**{**req.__dict__, "eos_token_ids": ()})
    errors = []
    first = threading.Thread(target=lambda: errors.append(pytest.raises(RunFailed, coordinator.run, plan, req)))
    first.start()
    try:
        deadline = time.monotonic() + 30
        while coordinator._run is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RunFailed, match="already in progress"):
            coordinator.run(plan, _request(model_dir, "sequential", 1, 2)[1])
    finally:
        coordinator.stop()
        first.join(60)  # an upper bound for a loaded host (the stop's promptness is the stop test's)
    assert errors and "stopped" in str(errors[0].value)
    assert {s.state for s in coordinator.status().values()} == {AgentState.READY}


def test_a_coordinator_held_up_past_the_heartbeat_timeout_does_not_declare_healthy_agents_lost(cluster, model_dir):
    """Sinks run on the coordinator's IO thread: one that blocks it for longer than the
    heartbeat timeout must not make the coordinator blame agents that did answer."""
    coordinator, plan, _ = cluster
    assert coordinator.heartbeat_timeout_s < 3.0
    lost = []
    coordinator.on_lost = lost.append

    class StallOnFirstToken(Recorder):
        def on_tokens(self, tokens):
            if not self.tokens:
                time.sleep(coordinator.heartbeat_timeout_s + 1.0)
            super().on_tokens(tokens)

    _, req = _request(model_dir, "no-bubbles", micro_batches=2, max_new_tokens=4)
    try:
        result = coordinator.run(plan, req, StallOnFirstToken())
    finally:
        coordinator.on_lost = None
    assert lost == [] and len(result.tokens) == len(PROMPTS)
    assert {s.state for s in coordinator.status().values()} == {AgentState.READY}


def test_a_model_directory_missing_on_a_device_is_an_error_naming_the_device_and_the_path(tmp_path):
    keys = CurveKeys.generate()
    agent = Agent("far-away", keys.public).start()
    try:
        with Coordinator([AgentEndpoint("far-away", agent.control_address, agent.keys.public)], keys) as co:
            missing = str(tmp_path / "not-copied-here")
            with pytest.raises(RunFailed) as info:
                co.load(plan_from_boundaries("m", 6, ["far-away"], []), missing)
            assert info.value.device == "far-away"
            assert missing in str(info.value) and "does not exist on device far-away" in str(info.value)
            assert not co.is_loaded(plan_from_boundaries("m", 6, ["far-away"], []), missing)
    finally:
        agent.close()


def test_loading_reports_the_agents_own_progress_while_their_shards_load(model_dir):
    from agents.executors import layers_executor
    from core.reporting import RecordingReporter

    def slow_real_load(model_dir, start, end, *, dtype, threads, progress=None):
        def slowly(fraction):  # a slow disk: every block takes a while to read
            progress(fraction)
            if fraction < 1:
                time.sleep(0.4)

        return layers_executor(model_dir, start, end, dtype=dtype, threads=threads, progress=slowly)

    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public, executor_factory=slow_real_load).start() for d in ("p", "q")]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            reporter = RecordingReporter()
            co.load(plan_from_boundaries("tiny-llama", 6, ["p", "q"], [3]), model_dir, reporter=reporter)
            done = [d for d, total in reporter.progresses]
            assert {total for _, total in reporter.progresses} == {2}
            assert done == sorted(done) and done[-1] == 2
            assert any(0 < d < 2 and d != 1 for d in done), done  # fractions of blocks, not just whole stages
    finally:
        for a in agents:
            a.close()


def test_a_run_on_agents_without_the_plan_loaded_fails_at_once_naming_the_device(model_dir):
    keys = CurveKeys.generate()
    agent = Agent("empty", keys.public).start()
    try:
        # a request timeout far above the bound: "at once" is then not "after a timed-out request"
        with Coordinator([AgentEndpoint("empty", agent.control_address, agent.keys.public)], keys,
                         request_timeout_s=60.0) as co:
            _, req = _request(model_dir, "sequential", 1, 2)
            t0 = time.monotonic()
            with pytest.raises(RunFailed, match="bad_state") as info:
                co.run(plan_from_boundaries("tiny-llama", 6, ["empty"], []), req)
            assert info.value.device == "empty" and time.monotonic() - t0 < 20  # room for a loaded host
    finally:
        agent.close()
