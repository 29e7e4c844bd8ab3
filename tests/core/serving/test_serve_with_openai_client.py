"""The official ``openai`` client against a real `edgeshard serve` over real local agents: the
tokens equal transformers' own ``generate`` on the same checkpoint, streams equal whole answers,
bad requests get the right status and OpenAI's error object, and the server answers after each."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from core.devices.cpu_placement import place_on_cpus
from core.sessions.store import SessionStore
from tests.core.serving.conftest import DEVICES

PROMPTS = ["the river", "a cat sat on the", "once upon a time", "snow fell", "the king said", "we went to",
           "in the morning", "she looked at", "the old man", "far away there", "it was a dark", "he ran into",
           "my friend and I", "under the bridge", "the ship sailed", "at the end of"]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").owned_by == "edgeshard"


def test_a_greedy_completion_equals_transformers_generate(client, reference):
    r = client.completions.create(model="tiny-llama", prompt="the river", max_tokens=8, temperature=0)
    assert r.choices[0].text == reference.complete("the river", 8)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(reference.tok("the river")["input_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_greedy_chat_uses_the_tokenizers_chat_template_and_equals_generate(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is the river?"}]
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference.chat(messages, 8)


def test_a_stream_adds_up_to_the_whole_answer_and_ends_with_done(client, server):
    whole = client.completions.create(model="tiny-llama", prompt="once upon a time", max_tokens=8)
    chunks = list(client.completions.create(model="tiny-llama", prompt="once upon a time", max_tokens=8,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    body = json.dumps({"model": "tiny-llama", "prompt": "snow", "max_tokens": 2, "stream": True}).encode()
    raw = _post(server, "/v1/completions", body)[1].decode()
    assert raw.rstrip().endswith("data: [DONE]")


def test_a_chat_stream_equals_the_chat_answer_and_reports_usage_last(client):
    messages = [{"role": "user", "content": "tell me of snow"}]
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_seeded_sampling_is_reproducible_and_the_seed_decides_the_text(client):
    ask = dict(model="tiny-llama", prompt="the old man", max_tokens=8, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **ask).choices[0].text
    b = client.completions.create(seed=7, **ask).choices[0].text
    others = {client.completions.create(seed=s, **ask).choices[0].text for s in (8, 9, 10)}
    assert a == b and len(others | {a}) > 1  # sampled (seeds differ in text), reproducibly


def test_a_stop_string_ends_the_answer_before_it(client, reference):
    full = reference.complete("we went to", 8)
    stop = full[3:5]
    r = client.completions.create(model="tiny-llama", prompt="we went to", max_tokens=8, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_all_complete_each_equal_to_its_reference(client, reference):
    def stream(prompt):
        return "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=6, stream=True))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(stream, PROMPTS))
    assert texts == [reference.complete(p, 6) for p in PROMPTS]


def test_a_seeded_request_gets_the_same_text_alone_and_as_a_row_beside_running_greedy_streams(client, reference):
    seeded = dict(model="tiny-llama", prompt="the old man", max_tokens=8, temperature=1.0, top_p=0.9, seed=11,
                  extra_body={"repetition_penalty": 1.2})
    alone = client.completions.create(**seeded).choices[0].text
    greedy = PROMPTS[:3]
    started = [threading.Event() for _ in greedy]

    def stream(i):
        chunks = client.completions.create(model="tiny-llama", prompt=greedy[i], max_tokens=24, stream=True)
        text = ""
        for c in chunks:
            started[i].set()
            text += c.choices[0].text
        return text

    with ThreadPoolExecutor(len(greedy)) as pool:
        streams = [pool.submit(stream, i) for i in range(len(greedy))]
        for e in started:
            assert e.wait(60)
        beside = client.completions.create(**seeded).choices[0].text  # rows first: it joins their micro-batch
        texts = [f.result() for f in streams]
    assert beside == alone
    assert texts == [reference.complete(p, 24) for p in greedy]


def _openai_greedy(reference, prompt: str, max_new_tokens: int, frequency: float = 0.0, presence: float = 0.0,
                   bias: dict[int, float] | None = None, *, count_prompt: bool = False) -> str:
    """The reference for OpenAI's penalties: a plain torch greedy loop over the checkpoint's forward, applying
    OpenAI's documented rule to the logits (mu[j] -= c[j] * frequency + (c[j] > 0) * presence, c[j] counting
    the generated tokens, or with ``count_prompt`` the prompt's too), then the bias, then argmax; it stops
    after EOS (id 2) as the server does."""
    import torch

    ids, generated = reference.tok(prompt)["input_ids"], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = reference.model(input_ids=torch.tensor([ids + generated])).logits[0, -1].float()
            counted = ids + generated if count_prompt else generated
            for j in set(counted):
                logits[j] -= counted.count(j) * frequency + presence
            for j, b in (bias or {}).items():
                logits[j] += b
            generated.append(int(logits.argmax()))
            if generated[-1] == 2:
                break
    return reference.tok.decode([t for t in generated if t != 2], skip_special_tokens=True)


PENALISED = [dict(prompt="we went to", frequency=0.75, presence=0.5, bias={}),
             dict(prompt="the king said", frequency=-0.5, presence=1.25, bias={7: 0.5}),
             dict(prompt="a cat sat on the", frequency=1.2, presence=0.8, bias={363: -100.0})]
"""Each changes the greedy text; the first only as OpenAI counts (not the prompt), the others only with their bias."""


def _penalised(client, ask, max_tokens=12):
    return client.completions.create(model="tiny-llama", prompt=ask["prompt"], max_tokens=max_tokens, temperature=0,
                                     frequency_penalty=ask["frequency"], presence_penalty=ask["presence"],
                                     logit_bias={str(k): v for k, v in ask["bias"].items()})


def _expected(reference, ask, max_tokens=12, **how):
    return _openai_greedy(reference, ask["prompt"], max_tokens, ask["frequency"], ask["presence"], ask["bias"], **how)


@pytest.mark.parametrize("ask", PENALISED, ids=["penalties", "negative-frequency-and-a-bias", "a-ban"])
def test_openais_penalties_and_logit_bias_equal_a_plain_torch_loop_applying_openais_rule(client, reference, ask):
    expected = _expected(reference, ask)
    assert _penalised(client, ask).choices[0].text == expected
    assert expected != reference.complete(ask["prompt"], 12)  # the settings change the text
    if ask["bias"]:
        assert expected != _expected(reference, {**ask, "bias": {}})
    else:  # the prompt's tokens are not counted (OpenAI's rule); counting them would give another text
        assert expected != _expected(reference, ask, count_prompt=True)


def test_seeded_sampling_with_penalties_is_reproducible_and_the_penalties_change_it(client):
    ask = dict(model="tiny-llama", prompt="the king said", max_tokens=12, temperature=1.0, seed=21)
    penalised = dict(frequency_penalty=1.5, presence_penalty=1.0, logit_bias={"9": 2.0})
    first = client.completions.create(**ask, **penalised).choices[0].text
    assert client.completions.create(**ask, **penalised).choices[0].text == first
    assert client.completions.create(**ask).choices[0].text != first


def test_two_requests_with_different_penalties_in_one_micro_batch_each_equal_their_own_reference(
        client, reference, server):
    started = threading.Event()

    def stream():
        text = ""
        for c in client.completions.create(model="tiny-llama", prompt="the river", max_tokens=40, stream=True):
            started.set()
            text += c.choices[0].text
        return text

    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(stream)
        assert started.wait(60)
        answers = [pool.submit(_penalised, client, ask) for ask in PENALISED[:2]]
        first, second = (f.result() for f in answers)
        assert running.result() == reference.complete("the river", 40)
    assert first.choices[0].text == _expected(reference, PENALISED[0])
    assert second.choices[0].text == _expected(reference, PENALISED[1])
    # rows first: both joined the running stream's micro-batch (their recorded events are its steps)
    slots = [{i.event.micro_batch for i in _recorded_run(server, r.id)[1] if i.event is not None}
             for r in (first, second)]
    assert len(slots[0]) == 1 and slots[0] == slots[1]


@pytest.mark.parametrize("extra, param", [(dict(presence_penalty=2.5), "presence_penalty"),
                                          (dict(frequency_penalty=-3), "frequency_penalty"),
                                          (dict(logit_bias={"512": 1}), "logit_bias"),
                                          (dict(logit_bias={"5": -101}), "logit_bias")],
                         ids=["presence", "frequency", "unknown-token", "bias-range"])
def test_an_out_of_range_penalty_or_bias_gets_400_naming_it_and_the_server_still_answers(client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, **extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    _still_answers(client)


def test_edgeshard_run_with_penalties_equals_the_reference_and_the_server(client, reference, server, tmp_path):
    import contextlib
    import io

    from core.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["run", "--model", str(server.model_dir), "--plan", str(server.model_dir.parent / "plan.json"),
                         "--local", "--prompt", "we went to", "--max-new-tokens", "12", "--frequency-penalty", "0.75",
                         "--presence-penalty", "0.5", "--json", "--no-record", "--threads", "1"])
    assert code == 0, out.getvalue()
    [text] = json.loads(out.getvalue().splitlines()[-1])["texts"]
    served = _penalised(client, PENALISED[0]).choices[0].text
    assert text == served == _expected(reference, PENALISED[0])


def _post(server, path, body: bytes, key="test-key-0123456789abcdef", content_type="application/json"):
    req = urllib.request.Request(server.url.removesuffix("/v1") + path, data=body, method="POST",
                                 headers={"Content-Type": content_type, **({"Authorization": f"Bearer {key}"}
                                                                           if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers


def _still_answers(client):
    assert client.completions.create(model="tiny-llama", prompt="snow", max_tokens=1).usage.completion_tokens == 1


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_key_gets_401(server, client, key):
    status, body, _ = _post(server, "/v1/completions", b'{"model": "tiny-llama", "prompt": "x"}', key=key)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    _still_answers(client)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": "hi"}', 400, "messages"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "n": 2}', 400, "n"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "logprobs": 2}', 400, "logprobs"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "frobnicate": 1}', 400, "frobnicate"),
    ("/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "the river " * 200}).encode(), 413, "prompt"),
    ("/v1/nothing", b"{}", 404, None),
], ids=["malformed-json", "wrong-type", "wrong-message-type", "unknown-model", "n=2", "logprobs", "unknown-field",
        "over-long-prompt", "unknown-route"])
def test_a_bad_request_gets_its_status_and_an_error_object_and_the_server_still_answers(
        server, client, path, body, status, param):
    got, raw, _ = _post(server, path, body)
    error = json.loads(raw)["error"]
    assert got == status and set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    _still_answers(client)


def test_a_body_declared_over_the_limit_gets_413_before_the_server_reads_it(server, client):
    import http.client

    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Content-Length", str(3 << 20)),
                        ("Authorization", "Bearer test-key-0123456789abcdef")):
        conn.putheader(name, value)
    conn.endheaders(b'{"model": "tiny-llama", "prompt": "')  # the rest never comes
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()
    _still_answers(client)


def _recorded_run(server, request_id: str):
    """The run recorded for ``request_id``, once finished (its record closes when its run ends,
    just after the client has its answer)."""
    deadline = time.monotonic() + 30
    while True:
        with SessionStore(server.workspace) as store:
            runs = [x for x in store.runs() if x.settings.get("request_id") == request_id]
            if runs and runs[0].status != "running" or time.monotonic() > deadline:
                return runs[0], store.timeline(runs[0].id)
        time.sleep(0.1)


def test_every_request_is_a_recorded_run_with_its_prompt_tokens_and_figures(client, server):
    r = client.completions.create(model="tiny-llama", prompt="far away there", max_tokens=5)
    run, items = _recorded_run(server, r.id)
    assert run.status == "completed" and run.settings["prompts"] == ["far away there"]
    assert run.settings["started_by"] == "edgeshard serve" and run.settings["endpoint"] == "/v1/completions"
    assert "".join(i.tokens.text[0] for i in items if i.tokens is not None) == r.choices[0].text
    assert {i.event.device for i in items if i.event is not None} == {"edge-0", "edge-1"}
    assert run.figures["completion_tokens"] == r.usage.completion_tokens and run.figures["server_ttft_s"] > 0
    wire = run.figures["wire"]  # what the agents' sockets sent while the request was recorded (no prediction)
    assert wire["per_link"]["edge-0->edge-1"]["measured"] > 0 and wire["predicted_bytes"] is None


def test_a_served_request_is_listed_by_edgeshard_sessions_and_replays(client, server, capsys):
    from core.cli import main as cli_main

    r = client.completions.create(model="tiny-llama", prompt="the ship sailed", max_tokens=4)
    run, _ = _recorded_run(server, r.id)
    assert cli_main(["sessions", "--workspace", str(server.workspace)]) == 0
    assert "edgeshard serve" in capsys.readouterr().out
    assert cli_main(["replay", str(run.id), "--workspace", str(server.workspace), "--speed", "1000"]) == 0
    assert f"done: {r.usage.completion_tokens} tokens" in capsys.readouterr().out


def test_a_client_that_disconnects_mid_stream_cancels_its_request(client, server):
    stream = client.completions.create(model="tiny-llama", prompt="under the bridge", max_tokens=150, stream=True)
    first = next(iter(stream))
    stream.close()
    run, _ = _recorded_run(server, first.id)
    assert run.status == "stopped" and run.figures["completion_tokens"] < 150
    _still_answers(client)


def test_a_client_that_disconnects_while_waiting_for_a_whole_answer_cancels_it(client, server):
    """The client leaves as soon as its run has started (its record is open), not after a fixed
    sleep: a fast run (a quiet machine, the run's end no longer waiting for a receive timeout)
    finished 120 tokens before a 0.3 s sleep was over."""
    import http.client

    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    prompt = "the last whole answer"
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 130}),
                 {"Content-Type": "application/json", "Authorization": "Bearer test-key-0123456789abcdef"})

    def runs_of_prompt():
        with SessionStore(server.workspace) as store:
            return [x for x in store.runs() if x.settings.get("prompts") == [prompt]]

    deadline = time.monotonic() + 30
    while not runs_of_prompt() and time.monotonic() < deadline:
        time.sleep(0.005)
    conn.sock.close()  # gone before the answer
    while True:
        runs = runs_of_prompt()
        if runs and runs[0].status != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert runs and runs[0].status == "stopped" and runs[0].figures["completion_tokens"] < 130
    _still_answers(client)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its agents, and the zygote they were forked from), from /proc."""
    parent = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    found, todo = [], [pid]
    while todo:
        above = todo.pop()
        kids = [p for p, pp in parent.items() if pp == above]
        found += kids
        todo += kids
    return found


def test_an_idle_local_server_has_its_agents_on_their_cores_and_itself_on_the_others(server, client):
    # serve --local places for one micro-batch in flight while idle (core.devices.cpu_placement, its
    # decisions tested there); the cores are the host's as this process sees them, not assumed
    client.completions.create(model="tiny-llama", prompt="the river", max_tokens=2, temperature=0)
    want = place_on_cpus(sorted(os.sched_getaffinity(0)), agents=len(DEVICES), threads_per_agent=1,
                         computing_at_once=0)
    deadline = time.monotonic() + 30  # the release that places again follows the answer; a bound on a hang
    while True:
        server_threads = {os.sched_getaffinity(int(t)) == want.coordinator
                          for t in os.listdir(f"/proc/{server.process.pid}/task")}
        placed = [p for p in _descendants(server.process.pid) if os.sched_getaffinity(p) == want.agents]
        if (server_threads == {True} and len(placed) >= len(DEVICES)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert server_threads == {True}
    assert len(placed) >= len(DEVICES)
