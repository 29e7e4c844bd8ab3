"""OpenAI request bodies are decoded strictly and checked against what the runtime can honour;
stop strings cut the text where OpenAI's API does; the plain chat template is the documented one."""

from __future__ import annotations

import json

import pytest

from core.serving.openai_api import ApiError, Defaults, StopText, parse_request, plain_chat_prompt

DEFAULTS = Defaults(max_tokens=32, temperature=0.0, seed=None)


def parse(kind="completion", **body):
    body.setdefault("model", "m")
    if kind == "completion":
        body.setdefault("prompt", "hi")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_request(json.dumps(body).encode(), kind, DEFAULTS)


def refused(kind="completion", **body) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(kind, **body)
    return err.value


def test_what_a_request_leaves_out_comes_from_the_servers_defaults():
    s = parse().sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (None, 0.0, 1.0, None, ())


def test_a_chat_takes_max_completion_tokens_over_max_tokens_and_text_parts():
    r = parse("chat", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}],
              max_tokens=3, max_completion_tokens=5)
    assert r.messages == (("user", "ab"),) and r.sampling.max_tokens == 5


@pytest.mark.parametrize("body, param", [
    (dict(n=2), "n"), (dict(best_of=3), "best_of"), (dict(echo=True), "echo"), (dict(logprobs=1), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(logit_bias={"5": 100.5}), "logit_bias"), (dict(logit_bias={"five": 1}), "logit_bias"),
    (dict(logit_bias={"-5": 1}), "logit_bias"), (dict(logit_bias={"5": 1, "05": 2}), "logit_bias"),
    (dict(prompt=["a", "b"]), "prompt"), (dict(temperature=3), "temperature"), (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=["a"] * 5), "stop"), (dict(seed=-1), "seed"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_a_parameter_the_runtime_cannot_honour_is_refused_naming_it(body, param):
    err = refused(**body)
    assert err.status == 400 and err.param == param


def test_openais_penalties_and_logit_bias_are_taken_by_token_id_and_the_servers_defaults_fill_them_in():
    s = parse(presence_penalty=0.5, frequency_penalty=-1.25, logit_bias={"7": -100, "3": 2.5}).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.5, -1.25, ((3, 2.5), (7, -100.0)))
    served = parse_request(b'{"model": "m", "prompt": "x", "presence_penalty": 0}', "completion",
                           Defaults(presence_penalty=1.5, frequency_penalty=0.5)).sampling
    assert (served.presence_penalty, served.frequency_penalty) == (0.0, 0.5)


def test_a_logit_bias_naming_a_token_the_model_lacks_is_refused_naming_it():
    from core.serving.openai_api import check_logit_bias

    s = parse(logit_bias={"511": 1, "512": -1}).sampling
    with pytest.raises(ApiError) as err:
        check_logit_bias(s, 512)
    assert (err.value.status, err.value.param) == (400, "logit_bias") and "512" in err.value.message
    check_logit_bias(s, 513)


@pytest.mark.parametrize("body, param", [(dict(tools=[{"type": "function"}]), "tools"),
                                         (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
                                         (dict(messages=[]), "messages")])
def test_chat_features_the_runtime_lacks_are_refused(body, param):
    assert refused("chat", **body).param == param


def test_wrong_types_and_unknown_fields_name_the_parameter():
    assert refused(max_tokens="5").param == "max_tokens"
    assert refused(frobnicate=1).param == "frobnicate"
    with pytest.raises(ApiError) as err:
        parse_request(b'{"prompt": "x"}', "completion", DEFAULTS)
    assert err.value.param == "model"


def test_the_error_object_has_openais_four_fields():
    assert set(refused(n=2).body()["error"]) == {"message", "type", "param", "code"}


def test_a_stop_string_split_over_pieces_is_never_sent_in_part():
    stop = StopText(("END",))
    sent = [stop.feed(p) for p in ["abc E", "N", "D more"]]
    assert sent == ["abc ", "", ""] and stop.hit


def test_text_that_only_looked_like_a_stop_string_is_sent_once_it_cannot_be_one():
    stop = StopText(("END",))
    assert [stop.feed(p) for p in ["a E", "Nx"]] == ["a ", "ENx"] and not stop.hit
    assert stop.feed("tail E") == "tail " and stop.flush() == "E"


def test_the_plain_chat_template_is_one_role_line_per_message_then_assistant():
    assert plain_chat_prompt((("system", "be brief"), ("user", "hi"))) == "System: be brief\nUser: hi\nAssistant:"
