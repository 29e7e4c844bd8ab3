"""Open runs (continuous batching) on real agent processes over 3 stages: micro-batches join while
others decode, each request's greedy tokens equal transformers' ``generate`` of its prompt alone, a
seeded request's tokens do not depend on who else runs, and a leave frees its KV caches at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from agents.protocol import SamplingSpec
from core.devices.local_cluster import LocalCluster
from core.runs.coordinator import Coordinator, NullSink
from core.runs.generation import GenerationSettings, load_plan
from core.runs.open_run import OpenRun
from tests.core.serving.conftest import serve_files

DEVICES = ["ob-0", "ob-1", "ob-2"]
EOS = 2


class Tokens(NullSink):
    """Tokens by sequence id, and when each sequence got its first."""

    def __init__(self) -> None:
        self.by_seq: dict[int, list[int]] = {}
        self.first: dict[int, float] = {}
        self.together: list[tuple[int, ...]] = []
        """Each step's sequence ids (the rows one forward ran)."""
        self.lock = threading.Lock()

    def on_tokens(self, tokens) -> None:
        with self.lock:
            self.together.append(tuple(tokens.sequence_ids))
            for s, t in zip(tokens.sequence_ids, tokens.token_ids):
                self.by_seq.setdefault(s, []).append(t)
                self.first.setdefault(s, time.monotonic())

    def wait(self, seqs, counts, timeout_s: float = 60.0) -> list[list[int]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                got = [list(self.by_seq.get(s, ())) for s in seqs]
            if all(len(g) >= c or (g and g[-1] == EOS) for g, c in zip(got, counts)):
                return got
            time.sleep(0.005)
        raise AssertionError(f"tokens did not arrive: {got}")


@pytest.fixture(scope="module")
def open_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("open-run")
    model, plan_path = serve_files(folder, devices=DEVICES, chat_template=None, max_positions=POSITIONS)
    from core import formats
    from core.planning.plan import ShardPlan

    plan = formats.load(plan_path, ShardPlan)
    with LocalCluster(folder / "cluster", DEVICES) as cluster:
        with Coordinator(cluster.endpoints, cluster.keys) as coord:
            load_plan(coord, plan, str(model), GenerationSettings(threads=1))
            sink = Tokens()
            run = OpenRun(coord, plan, sink, slots=4, mode="no-bubbles", eos_token_ids=(EOS,), pad_token_id=0)
            run.start()
            try:
                yield run, sink, coord, model
            finally:
                run.close()


@pytest.fixture(scope="module")
def reference(open_run):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(open_run[3]).eval()


def generate(model, ids: list[int], n: int, **sampling) -> list[int]:
    import torch

    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, pad_token_id=0, eos_token_id=EOS, do_sample=False, **sampling)
    new = out[0, len(ids):].tolist()
    return new[:new.index(EOS) + 1] if EOS in new else new


HOLD = 1000
"""A running row's budget that no host's join latency outruns (the module's checkpoint has ``POSITIONS``): rows
that join "its running micro-batch" must find it running, whatever the load. A row of budget 24 was done before
the join reached the source once, at load ~16 (~150 steps a second at load 20): the rows started a micro-batch of
their own. ``end_holder`` makes it leave once the joined rows are done."""
POSITIONS = 1024


def end_holder(run, coord, sink, slot: int, seq: int) -> list[int]:
    """``seq`` leaves ``slot``'s micro-batch (its other rows are done): its tokens once the micro-batch is retired
    on every stage. Every token it got is compared, as many as it got (a prefix of its prompt's alone)."""
    run.leave([seq])
    deadline = time.monotonic() + 30  # a bound on a hang, not a speed threshold
    while any(s.kv_bytes for s in coord.status_of(DEVICES).values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    run.release(slot)
    with sink.lock:
        return list(sink.by_seq[seq])


def test_a_join_of_a_slot_above_slots_that_never_ran_starts_at_once(open_run, reference):
    # First in the module, so the run is fresh alone and in the module: slots 0 and 1 have never run. It
    # waited forever for its tokens (stop 35): the source deferred any index past the next one it knew.
    # ``wait`` gives up after 60 s (not a speed threshold: a bound on a hang).
    run, sink, _, _ = open_run
    prompt = [6, 40, 13, 2 + 1]
    (seq,) = run.join(2, [prompt], [8], SamplingSpec())
    got = sink.wait([seq], [8])
    run.release(2)
    assert got == [generate(reference, prompt, 8)]



def test_the_micro_batches_in_flight_are_told_before_a_join_goes_out_and_after_a_release(open_run):
    # what ``serve --local`` places its agents by (core.devices.cpu_placement): a join's prefill must find
    # them placed, so the count is told before the join is sent; a grow or a second release tells nothing
    run, sink, _, _ = open_run
    told: list[int] = []
    run.on_busy = told.append
    try:
        (a,) = run.join(1, [[7, 8, 9]], [HOLD], SamplingSpec())
        assert told == [1]
        sink.wait([a], [1])
        (b,) = run.join(1, [[5, 6]], [2], SamplingSpec(), grow=True)
        (c,) = run.join(3, [[4, 5, 6]], [2], SamplingSpec())
        assert told == [1, 2]
        sink.wait([b, c], [2, 2])
        run.release(3)
        run.release(3)
        assert told == [1, 2, 1]
        end_holder(run, sink=sink, coord=open_run[2], slot=1, seq=a)
        assert told == [1, 2, 1, 0]
    finally:
        run.on_busy = lambda in_flight: None


def test_an_open_run_keeps_none_of_its_stream_in_memory(open_run):
    # A server's open run serves for hours: every token and event it kept stayed in memory (its result is never
    # read). They go to its sink only; the latest end of each stage's work is still known (a failure box's start).
    run, sink, coord, _ = open_run
    (seq,) = run.join(3, [[9, 21, 4]], [6], SamplingSpec())
    sink.wait([seq], [6])
    run.release(3)
    active = coord.active_run
    assert sink.by_seq[seq] and active.tokens == [] and active.events == []
    deadline = time.monotonic() + 30  # the agents send their events every ~50 ms; a bound on a hang
    while not all(active.last_heard(d) > 0 for d in DEVICES) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(active.last_heard(d) > 0 for d in DEVICES)

def test_a_request_joining_while_another_decodes_gets_the_tokens_of_its_prompt_alone(open_run, reference):
    run, sink, _, _ = open_run
    long_prompt, late_prompt = [5, 17, 99, 3, 42, 8], [7, 300, 12]
    (first,) = run.join(0, [long_prompt], [40], SamplingSpec())
    sink.wait([first], [3])  # the first one decodes
    (late,) = run.join(1, [late_prompt], [12], SamplingSpec())
    got_late, got_first = sink.wait([late, first], [12, 40])
    assert sink.first[late] < sink.first[first] + 10  # sanity: it started while the other ran
    with sink.lock:
        assert len(sink.by_seq[first]) >= 3
    assert got_late == generate(reference, late_prompt, 12)
    assert got_first == generate(reference, long_prompt, 40)
    run.release(0)
    run.release(1)


def test_a_seeded_request_gets_the_same_tokens_whoever_else_runs(open_run):
    run, sink, _, _ = open_run
    spec = SamplingSpec(temperature=0.9, top_p=0.95, seed=1234)
    (alone,) = run.join(0, [[9, 8, 7]], [16], spec)
    (alone_tokens,) = sink.wait([alone], [16])
    run.release(0)
    (busy,) = run.join(1, [[4, 4, 4, 4]], [30], SamplingSpec())
    (again,) = run.join(0, [[9, 8, 7]], [16], spec)
    (again_tokens,) = sink.wait([again], [16])
    sink.wait([busy], [30])
    run.release(0)
    run.release(1)
    assert again_tokens == alone_tokens


def test_a_leave_frees_the_micro_batchs_kv_cache_on_every_stage_at_once(open_run):
    run, sink, coord, _ = open_run
    (seq,) = run.join(2, [[11, 12, 13, 14]], [500], SamplingSpec())
    sink.wait([seq], [4])
    held = {d: s.kv_bytes for d, s in coord.status_of(DEVICES).items()}
    assert all(b > 0 for b in held.values()), held
    run.leave([seq])
    deadline = time.monotonic() + 30  # an upper bound for a loaded host: "at once" is the < 500 tokens below
    while time.monotonic() < deadline:
        now = {d: s.kv_bytes for d, s in coord.status_of(DEVICES).items()}
        if not any(now.values()):
            break
        time.sleep(0.01)
    assert now == {d: 0 for d in DEVICES}
    with sink.lock:
        assert len(sink.by_seq[seq]) < 500
    run.release(2)
    (again,) = run.join(2, [[11, 12]], [3], SamplingSpec())  # the slot is usable again
    assert len(sink.wait([again], [3])[0]) == 3
    run.release(2)


def test_rows_joining_and_leaving_a_running_micro_batch_get_the_tokens_of_their_prompts_alone(open_run, reference):
    run, sink, coord, _ = open_run
    a, b, c, d = [5, 17, 99, 3, 42, 8], [7, 300, 12], [4, 4, 9, 100, 31, 6, 1, 77], [9, 9, 9]
    (first,) = run.join(3, [a], [HOLD], SamplingSpec())  # runs until it leaves: the micro-batch runs when they join
    sink.wait([first], [3])  # it decodes: the next two join its running micro-batch
    second, third = run.join(3, [b, c], [4, 30], SamplingSpec(), grow=True)
    sink.wait([second], [4])  # the second is done (its budget): its row leaves, the others go on
    (fourth,) = run.join(3, [d], [6], SamplingSpec(), grow=True)
    got = sink.wait([second, third, fourth], [4, 30, 6])
    got_first = end_holder(run, coord, sink, 3, first)
    assert got == [generate(reference, b, 4), generate(reference, c, 30), generate(reference, d, 6)]
    assert got_first == generate(reference, a, len(got_first))
    with sink.lock:
        together = [set(t) for t in sink.together]
    assert {first, second, third} in together  # one forward ran the running row and the joined ones
    assert any({first, fourth} <= t and second not in t for t in together)  # the done row left, another joined


def test_rows_that_join_while_one_step_runs_are_prefilled_together_in_the_next_step(open_run, reference):
    run, sink, coord, _ = open_run
    a, b, c = [8, 21, 5, 60], [7, 300, 12, 40, 41, 200, 9], [11, 3]
    not_awaited = {"on_refused": lambda err: pytest.fail(str(err))}
    slot = run.free_slot()  # the slot serve would take (the lowest free one)
    # the three joins must all be at the source before its first step is back: sent back to back, a loaded
    # host's IO thread may send the third a step later (failed once at load 19). So the source is stopped
    # until all three are out: the last stage answered a status asked after them (one IO thread, in order)
    source = coord.status_of([DEVICES[0]])[DEVICES[0]].pid
    os.kill(source, signal.SIGSTOP)
    try:
        (first,) = run.join(slot, [a], [12], SamplingSpec(), **not_awaited)
        (second,) = run.join(slot, [b], [9], SamplingSpec(), grow=True, **not_awaited)  # two joins, two widths,
        (third,) = run.join(slot, [c], [10], SamplingSpec(), grow=True, **not_awaited)  # sent during its prefill
        coord.status_of([DEVICES[-1]], timeout_s=30.0)
    finally:
        os.kill(source, signal.SIGCONT)
    got = sink.wait([first, second, third], [12, 9, 10])
    run.release(slot)
    assert got == [generate(reference, a, 12), generate(reference, b, 9), generate(reference, c, 10)]
    with sink.lock:
        firsts = [t for t in sink.together if second in t or third in t]
    assert {first, second, third} <= set(firsts[0])  # one grown step took both joins (not one step each)


def test_sampled_and_penalised_rows_joining_a_running_micro_batch_get_the_tokens_they_get_alone(open_run, reference):
    run, sink, coord, _ = open_run
    greedy, sampled, penalised, both = [5, 17, 99, 3, 42, 8], [9, 8, 7], [4, 4, 9, 4, 4, 9], [30, 31, 30, 31]
    specs = {"sampled": ([sampled], [10], SamplingSpec(temperature=0.9, top_p=0.95, seed=77)),
             "penalised": ([penalised], [12], SamplingSpec(repetition_penalty=1.5)),
             "both": ([both], [14], SamplingSpec(temperature=0.8, seed=5, repetition_penalty=1.3,
                                                 no_repeat_ngram_size=2))}
    alone = {name: run.join(slot, *spec)[0] for slot, (name, spec) in enumerate(specs.items())}  # one slot each
    alone_tokens = dict(zip(alone, sink.wait(list(alone.values()), [10, 12, 14])))
    for slot in range(len(specs)):
        run.release(slot)
    slot = run.free_slot()
    (first,) = run.join(slot, [greedy], [HOLD], SamplingSpec())  # runs until it leaves
    sink.wait([first], [3])  # it decodes: the others join its running micro-batch as rows
    joined = {name: run.join(slot, *spec, grow=True)[0] for name, spec in specs.items()}
    got = sink.wait(list(joined.values()), [10, 12, 14])
    got_first = end_holder(run, coord, sink, slot, first)
    assert dict(zip(joined, got)) == alone_tokens  # their draws and penalties are their own
    assert got_first == generate(reference, greedy, len(got_first))
    assert alone_tokens["penalised"] == generate(reference, penalised, 12, repetition_penalty=1.5)
    with sink.lock:
        together = [set(t) for t in sink.together]
    # each joined the running row's micro-batch (a forward ran it beside the running row); not all at once: a
    # row may be done before the last join lands (budget 10, three joins awaited in turn: failed once at load 20)
    assert all(any({first, s} <= t for t in together) for s in joined.values())


def test_a_join_not_waited_for_is_accepted_once_every_stage_accepted_it_and_never_after_a_refusal():
    """What the server waits for before it writes a request's record and sends a stream's headers."""
    import concurrent.futures as cf

    from agents.protocol import ErrorReply, Ok
    from core.runs.open_run import _JoinReplies

    def told(replies: list) -> tuple[list, list]:
        refused, accepted = [], []
        join = _JoinReplies(len(replies), refused.append, lambda: accepted.append(True))
        for device, reply in replies:
            fut = cf.Future()
            fut.set_result(reply) if not isinstance(reply, Exception) else fut.set_exception(reply)
            join.reply(device, fut)
        return refused, accepted

    assert told([("a", Ok()), ("b", Ok())]) == ([], [True])
    refused, accepted = told([("a", ErrorReply(code="bad_state", message="not running")), ("b", Ok())])
    assert [e.device for e in refused] == ["a"] and accepted == []
    refused, accepted = told([("a", Ok()), ("b", OSError("link closed")), ("c", ErrorReply(code="busy", message="-"))])
    assert [e.device for e in refused] == ["b"] and accepted == []
