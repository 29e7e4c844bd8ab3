"""`edgeshard serve` checks its arguments and files before any agent starts (one line, exit 2),
and a request is admitted with its prompt rendered, tokenized and measured against the context."""

from __future__ import annotations

import socket

import pytest

from core.cli import main as cli_main
from core.runs.generation import GenerationSettings, load_tokenizer
from core.serving import ApiError, Defaults, ServedModel, ServeSettings
from core.serving.openai_api import parse_request

from tests.core.serving.conftest import CONTEXT, serve_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A checkpoint whose tokenizer has no chat template, and a plan for it."""
    return serve_files(tmp_path_factory.mktemp("entrance"), chat_template=None)


def serve(capsys, files, *extra) -> tuple[int, str]:
    model, plan = files
    code = cli_main(["serve", "--model", str(model), "--plan", str(plan), "--local", "--no-record", *extra])
    err = capsys.readouterr().err
    return code, err


def test_listening_beyond_loopback_without_a_key_is_refused_in_one_line(capsys, files):
    code, err = serve(capsys, files, "--host", "0.0.0.0")
    assert code == 2 and "without --api-key-file" in err and len(err.strip().splitlines()) == 1


def test_an_empty_key_file_is_refused(capsys, files, tmp_path):
    (tmp_path / "key").write_text("\n")
    code, err = serve(capsys, files, "--api-key-file", str(tmp_path / "key"))
    assert code == 2 and "one key" in err and "Traceback" not in err


def test_a_port_in_use_is_refused_before_any_agent_starts(capsys, files):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        code, err = serve(capsys, files, "--port", str(taken.getsockname()[1]))
    assert code == 2 and "cannot listen on 127.0.0.1" in err
    assert "starting" not in err  # no agent was started


def test_placing_cores_for_agents_the_server_does_not_start_is_refused_in_one_line(capsys, files, tmp_path):
    model, plan = files
    code = cli_main(["serve", "--model", str(model), "--plan", str(plan), "--agents", str(tmp_path / "agents.json"),
                     "--local-cpus", "split", "--no-record"])
    err = capsys.readouterr().err
    assert code == 2 and "--local-cpus" in err and len(err.strip().splitlines()) == 1


def test_a_plan_that_does_not_fit_the_checkpoint_is_refused(capsys, files, tmp_path):
    from core import formats
    from core.planning.plan import plan_from_boundaries

    model, _ = files
    bad = tmp_path / "plan.json"
    formats.save(bad, plan_from_boundaries("tiny-llama", 9, ["a", "b"], [4]))
    code, err = serve(capsys, (model, bad))
    assert code == 2 and "plan is invalid" in err


@pytest.fixture(scope="module")
def served(files):
    model, plan = files
    from core import formats
    from core.planning.plan import ShardPlan

    return ServedModel(None, formats.load(plan, ShardPlan), str(model), "tiny-llama", load_tokenizer(str(model)),
                       ServeSettings(GenerationSettings(), max_tokens=64))


def _parse(body: bytes, kind="chat"):
    return parse_request(body, kind, Defaults())


def test_a_chat_without_a_template_is_rendered_with_the_plain_one(served):
    r = served.admit(_parse(b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}'), print)
    assert r.prompt_text == "User: hi\nAssistant:"
    assert r.prompt_ids == tuple(served.tokenizer("User: hi\nAssistant:")["input_ids"])


def test_max_tokens_left_out_is_the_default_capped_by_the_context_left(served):
    prompt = "the river " * 30
    r = served.admit(_parse(('{"model": "tiny-llama", "prompt": "%s"}' % prompt).encode(), "completion"), print)
    assert r.max_tokens == min(64, CONTEXT - len(r.prompt_ids))


def test_asking_for_more_tokens_than_the_context_holds_is_413(served):
    with pytest.raises(ApiError) as err:
        served.admit(_parse(b'{"model": "tiny-llama", "prompt": "x", "max_tokens": %d}' % CONTEXT, "completion"),
                     print)
    assert err.value.status == 413 and err.value.code == "context_length_exceeded"


def test_a_full_queue_answers_429_with_retry_after_over_http(served):
    """The queue's refusal through the real app and uvicorn (the cluster held busy by a run that
    waits for the test), as the official client sees it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from core.serving import BatchQueue, HttpServer, bind, build_app
    from core.serving.openai_api import unavailable

    release = threading.Event()

    def busy_run(batch):
        release.wait(30)
        for r in batch:
            r.fail(unavailable("the test is over"))

    queue = BatchQueue(busy_run, max_waiting=1, max_batch=1)
    http = HttpServer(build_app(served, queue, defaults=Defaults()), bind("127.0.0.1", 0))
    http.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="-", max_retries=0, timeout=60)
    ask = dict(model="tiny-llama", prompt="the river", max_tokens=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.completions.create, **ask)
            _wait_until(lambda: queue.running == 1)
            waiting = pool.submit(client.completions.create, **ask)
            _wait_until(lambda: queue.waiting == 1)
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(**ask)
            assert int(err.value.response.headers["retry-after"]) >= 1
            assert err.value.body["code"] == "queue_full"
            release.set()
            for f in (running, waiting):
                with pytest.raises(openai.APIStatusError):
                    f.result(30)
    finally:
        release.set()
        queue.close()
        http.stop()


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
