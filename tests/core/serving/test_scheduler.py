"""The bounded queue: which waiting requests share a run, 429 when full, cancelled ones dropped."""

from __future__ import annotations

import threading

import pytest

from core.serving.openai_api import ApiError, Defaults, parse_request
from core.serving.scheduler import BatchQueue, choose_batch
from core.serving.served import ServedRequest


def test_the_next_run_takes_the_oldest_and_every_waiting_request_of_its_kind():
    greedy, other = ("greedy", 1.0, 0), ("greedy", 1.3, 0)
    assert choose_batch([greedy, other, greedy, greedy], max_batch=16) == [0, 2, 3]
    assert choose_batch([greedy, greedy, greedy], max_batch=2) == [0, 1]


def test_a_sampled_request_runs_alone_so_its_seed_decides_its_text():
    assert choose_batch([None, None, ("greedy", 1.0, 0)], max_batch=16) == [0]
    assert choose_batch([("greedy", 1.0, 0), None], max_batch=16) == [0]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _request(deliveries: list) -> ServedRequest:
    parsed = parse_request(b'{"model": "m", "prompt": "x"}', "completion", Defaults())
    return ServedRequest("cmpl-1", parsed, "x", (5,), 4, 0, _Tokenizer(), (2,), deliveries.append)


@pytest.fixture
def blocked_queue():
    """A queue whose runs wait until released (the cluster busy): (queue, batches run, release)."""
    release, ran = threading.Event(), []

    def run_batch(batch):
        ran.append(batch)
        release.wait(10)
        for r in batch:
            r.take(2)

    queue = BatchQueue(run_batch, max_waiting=2, max_batch=8)
    yield queue, ran, release
    release.set()
    queue.close()


def _wait_for(cond, timeout_s=30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_full_queue_refuses_with_429_and_retry_after(blocked_queue):
    queue, ran, release = blocked_queue
    queue.submit(_request([]))
    _wait_for(lambda: ran)  # the cluster is busy with the first
    queue.submit(_request([]))
    queue.submit(_request([]))
    with pytest.raises(ApiError) as err:
        queue.submit(_request([]))
    assert err.value.status == 429 and int(err.value.headers["Retry-After"]) >= 1


def test_requests_that_wait_together_share_the_next_run_and_a_cancelled_one_is_dropped(blocked_queue):
    queue, ran, release = blocked_queue
    queue.submit(_request([]))
    _wait_for(lambda: ran)
    kept, gone = _request([]), _request([])
    queue.submit(kept)
    queue.submit(gone)
    queue.cancel(gone)
    release.set()
    _wait_for(lambda: len(ran) == 2)
    assert ran[1] == [kept]


def test_closing_fails_the_waiting_and_the_running_requests_with_503_and_ends_the_run():
    release, ran = threading.Event(), []

    def run_batch(batch):
        ran.append(batch)
        release.wait(10)

    queue = BatchQueue(run_batch, max_waiting=4, max_batch=1, on_cancel_running=lambda batch: release.set())
    running, waiting = [], []
    queue.submit(_request(running))
    _wait_for(lambda: ran)
    queue.submit(_request(waiting))
    queue.close()
    assert [d.error.status for d in running + waiting] == [503, 503] and release.is_set() and len(ran) == 1
    with pytest.raises(ApiError) as err:
        queue.submit(_request([]))
    assert err.value.status == 503


def test_a_burst_is_spread_over_the_plans_micro_batches_and_a_lone_request_takes_one():
    from core.serving.scheduler import spread

    assert [list(r) for r in spread(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in spread(1, 3)] == [[0]]


def test_requests_wait_while_every_micro_batch_is_busy_and_join_when_one_is_freed():
    free, started = [0], []
    queue = BatchQueue(lambda group: started.append(group), max_waiting=4, max_batch=8, capacity=lambda: free[0],
                       spread=2)
    try:
        a, b, c = _request([]), _request([]), _request([])
        for r in (a, b, c):
            queue.submit(r)
        import time

        time.sleep(0.05)
        assert started == [] and queue.waiting == 3
        free[0] = 2
        queue.wake()
        _wait_for(lambda: len(started) == 2)
        assert started == [[a, b], [c]] and queue.waiting == 0
    finally:
        queue.close()


def test_rows_join_a_running_micro_batch_only_of_a_model_whose_every_block_attends_its_whole_past():
    from core.serving.model_config import full_attention_only

    assert full_attention_only({"model_type": "llama", "sliding_window": None})
    assert full_attention_only({"layer_types": ["full_attention"] * 2, "sliding_window": 4096})
    assert not full_attention_only({"layer_types": ["full_attention", "sliding_attention"]})
    assert not full_attention_only({"model_type": "mistral", "sliding_window": 4096})
    assert not full_attention_only({"text_config": {"sliding_window": 512}})


def test_requests_join_the_running_micro_batch_with_room_before_another_opens():
    from core.serving.cluster_runs import growable

    assert growable({0: (5, False), 1: (3, False)}, 4, 16) == 1  # the fewest live rows
    assert growable({0: (14, False)}, 2, 16) == 0
    assert growable({0: (14, False)}, 3, 16) is None  # no room for all three
    assert growable({0: (0, False)}, 1, 16) is None  # every row done: it retires
    assert growable({0: (2, True)}, 1, 16) is None  # resumed after a failure: it keeps its rows
    assert growable({}, 1, 16) is None


def test_a_sampled_request_joins_alone_and_greedy_ones_with_the_same_controls_share_a_join():
    import json

    from core.serving.cluster_runs import join_groups

    def request(**body):
        parsed = parse_request(json.dumps({"model": "m", "prompt": "x", **body}).encode(), "completion", Defaults())
        return ServedRequest("cmpl-1", parsed, "x", (5,), 4, 0, _Tokenizer(), (2,), lambda delivery: None)

    greedy = [request(temperature=0), request(temperature=0)]
    penalised = request(temperature=0, repetition_penalty=1.3)
    sampled = [request(temperature=0.8, seed=1), request(temperature=0.8, seed=1)]
    mixed = [greedy[0], sampled[0], penalised, greedy[1], sampled[1]]
    assert join_groups(mixed) == [[greedy[0], greedy[1]], [sampled[0]], [penalised], [sampled[1]]]


def test_a_request_at_an_idle_cluster_joins_on_the_submitting_thread_and_a_later_one_waits_for_the_worker():
    """The first skips the worker's wake-up (a thread hop on its TTFT); while it runs, the next is queued for the
    worker, which takes what waits together; and a join that cannot happen now (False) is queued too."""
    threads, release = [], threading.Event()

    def start(batch):  # the worker's way
        threads.append(("worker", threading.current_thread().name, len(batch)))
        for r in batch:
            r.take(2)

    def now(batch):  # on the caller's thread, if it can
        if release.is_set():
            return False
        threads.append(("now", threading.current_thread().name, len(batch)))
        return True

    queue = BatchQueue(start, max_waiting=4, max_batch=8, join_now=now)
    try:
        first, second = _request([]), _request([])
        queue.submit(first)  # joined here, still running (no token yet)
        queue.submit(second)
        _wait_for(lambda: second.done)
        assert threads == [("now", threading.current_thread().name, 1), ("worker", "edgeshard-serve-batches", 1)]
        first.take(2)
        queue.wake()
        release.set()  # the run cannot be joined without waiting now: the worker joins the next one
        third = _request([])
        queue.submit(third)
        _wait_for(lambda: third.done)
        assert threads[-1] == ("worker", "edgeshard-serve-batches", 1)
    finally:
        queue.close()
