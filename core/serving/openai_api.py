"""The OpenAI wire shapes: request bodies decoded strictly, responses and stream chunks built.

Pure functions over bytes and plain values (no sockets, no cluster), so every rule is tested
alone. Bodies are decoded with ``msgspec`` into typed structs: a wrong type or an unknown
field is a 400 naming the parameter (as OpenAI's own API answers), never silently ignored. A
parameter OpenAI defines that this runtime cannot honour (``n > 1``, logprobs, tools) is a 400
saying so. ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` are honoured per request
(agents/sampling.py applies them). Extensions beyond OpenAI's set are the runtime's own
repetition controls, ``repetition_penalty`` and ``no_repeat_ngram_size`` (HF's meanings, as
``edgeshard run``'s options).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

from agents.protocol import MAX_LOGIT_BIAS


class ApiError(Exception):
    """An answer other than success: the HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unavailable(why: str) -> ApiError:
    """503: the cluster cannot serve (a lost agent, a plan not loaded, the server stopping)."""
    return ApiError(503, f"the cluster is unavailable: {why}", type="server_error", code="cluster_unavailable")


# ------------------------------------------------------------------------------ bodies
class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str = ""


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None


class CompletionBody(_Common):
    prompt: str | list[str] = ""
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Common):
    messages: list[Message] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None


Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Sampling:
    """What one request asks of the sampler and the run (the server's defaults filled in)."""

    max_tokens: int | None
    """None: the server's default, capped by the context left after the prompt."""
    temperature: float
    top_p: float
    seed: int | None
    """None: a seed of the server's choosing (recorded with the request)."""
    stop: tuple[str, ...]
    repetition_penalty: float
    no_repeat_ngram_size: int
    frequency_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: per time a token was generated so far, subtracted from its logit."""
    presence_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: subtracted from the logit of every token generated so far."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's: (token id, bias in [-100, 100]) pairs, by id (ids checked against the model's vocabulary
    at admission: ``check_logit_bias``)."""

    def applied_to(self, settings, seed: int, max_tokens: int):
        """``settings`` (the server's ``core.runs.generation.GenerationSettings``) with this sampling: what a
        request's join samples with and its run records."""
        return replace(settings, temperature=self.temperature, top_p=self.top_p, seed=seed, max_new_tokens=max_tokens,
                       repetition_penalty=self.repetition_penalty, no_repeat_ngram_size=self.no_repeat_ngram_size,
                       frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                       logit_bias=self.logit_bias)


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    model: str
    prompt: str | None
    """A completion's prompt text (None for chat)."""
    messages: tuple[tuple[str, str], ...]
    """A chat's (role, text) messages."""
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Defaults:
    """The server's sampling defaults (``edgeshard serve``'s options) for what a request leaves out."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


MAX_STOP_STRINGS = 4
ROLES = ("system", "developer", "user", "assistant")


def _param_of(message: str) -> str | None:
    """``$.messages[0].role`` in a msgspec error -> ``messages``; unknown field -> its name."""
    if "unknown field `" in message:
        return message.split("unknown field `", 1)[1].split("`", 1)[0]
    if "- at `$." in message:
        path = message.rsplit("- at `$.", 1)[1].rstrip("`")
        return path.split(".", 1)[0].split("[", 1)[0]
    if "missing required field `" in message:
        return message.split("missing required field `", 1)[1].split("`", 1)[0]
    return None


def decode_body(raw: bytes, kind: Kind) -> CompletionBody | ChatBody:
    """The body as its struct; 400 for bad JSON, a wrong type or an unknown field."""
    typ = CompletionBody if kind == "completion" else ChatBody
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as err:
        text = str(err)
        param = _param_of(text)
        if "unknown field" in text:
            text = f"unrecognized request argument supplied: {param}"
        raise ApiError(400, text, param=param, code="invalid_type" if "Expected" in text else None) from None
    except msgspec.DecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})", code="invalid_json") from None


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what}", param=param, code="unsupported_parameter")


def _range(param: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ApiError(400, f"{param} must be {allowed}, got {value!r}", param=param, code="invalid_value")


def parse_request(raw: bytes, kind: Kind, defaults: Defaults) -> ParsedRequest:
    """Decode and check one body against what the runtime can do; ``ApiError`` (400) otherwise."""
    body = decode_body(raw, kind)
    if body.n != 1:
        raise _unsupported("n", f"only n=1 is served (got {body.n}); send several requests: concurrent "
                                "requests are batched")
    if isinstance(body, CompletionBody):
        if body.echo:
            raise _unsupported("echo", "not supported")
        if body.logprobs is not None:
            raise _unsupported("logprobs", "not supported")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "only 1 is served")
        if body.suffix:
            raise _unsupported("suffix", "not supported")
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise _unsupported("prompt", f"one prompt per request (got {len(prompt)}); send several "
                                             "requests: concurrent requests are batched")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt must be a non-empty string", param="prompt", code="invalid_value")
        messages: tuple[tuple[str, str], ...] = ()
        max_tokens = body.max_tokens
    else:
        for p in ("tools", "tool_choice", "functions", "function_call", "response_format", "top_logprobs"):
            if getattr(body, p) is not None:
                raise _unsupported(p, "not supported by this runtime")
        if body.logprobs:
            raise _unsupported("logprobs", "not supported")
        messages = tuple(_message(i, m) for i, m in enumerate(body.messages))
        if not messages:
            raise ApiError(400, "messages must hold at least one message", param="messages", code="invalid_value")
        prompt = None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(body, max_tokens, defaults)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return ParsedRequest(kind=kind, model=body.model, prompt=prompt, messages=messages, sampling=sampling,
                         stream=body.stream, include_usage=include_usage)


def _message(i: int, m: Message) -> tuple[str, str]:
    if m.role not in ROLES:
        raise _unsupported(f"messages[{i}].role", f"{m.role!r} is not served (one of {', '.join(ROLES)})")
    if isinstance(m.content, list):
        kinds = {p.type for p in m.content}
        if kinds - {"text"}:
            raise _unsupported(f"messages[{i}].content", f"only text parts are served, got {sorted(kinds)}")
        return m.role, "".join(p.text for p in m.content)
    return m.role, m.content or ""


def _sampling(body: _Common, max_tokens: int | None, d: Defaults) -> Sampling:
    if max_tokens is not None:
        _range("max_tokens", max_tokens, 1 <= max_tokens <= 1 << 20, "an integer >= 1")
    t = d.temperature if body.temperature is None else body.temperature
    _range("temperature", t, math.isfinite(t) and 0 <= t <= 2, "a number in [0, 2]")
    p = d.top_p if body.top_p is None else body.top_p
    _range("top_p", p, math.isfinite(p) and 0 < p <= 1, "a number in (0, 1]")
    seed = d.seed if body.seed is None else body.seed
    if seed is not None:
        _range("seed", seed, 0 <= seed < 1 << 63, "an integer in [0, 2**63)")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    _range("stop", list(stop), len(stop) <= MAX_STOP_STRINGS and all(stop),
           f"at most {MAX_STOP_STRINGS} non-empty strings")
    rp = d.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty
    _range("repetition_penalty", rp, math.isfinite(rp) and 0 < rp <= 100, "a number in (0, 100] (1 = off)")
    ng = d.no_repeat_ngram_size if body.no_repeat_ngram_size is None else body.no_repeat_ngram_size
    _range("no_repeat_ngram_size", ng, 0 <= ng <= 64, "an integer in [0, 64] (0 = off)")
    penalties = {}
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(d, name) if getattr(body, name) is None else getattr(body, name)
        _range(name, v, math.isfinite(v) and -2 <= v <= 2, "a number in [-2, 2] (0 = off)")
        penalties[name] = float(v)
    return Sampling(max_tokens=max_tokens, temperature=t, top_p=p, seed=seed, stop=stop, repetition_penalty=rp,
                    no_repeat_ngram_size=ng, logit_bias=_logit_bias(body.logit_bias or {}), **penalties)


def _logit_bias(given: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a decimal string -> bias in [-100, 100]) as sorted pairs."""
    _range("logit_bias", f"{len(given)} entries", len(given) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} entries")
    pairs: dict[int, float] = {}
    for key, bias in given.items():
        _range("logit_bias", key, re.fullmatch(r"[0-9]{1,10}", key) is not None and int(key) not in pairs,
               "keyed by token ids (decimal integers >= 0, each once)")
        _range("logit_bias", {key: bias}, math.isfinite(bias) and -100 <= bias <= 100, "holding biases in [-100, 100]")
        pairs[int(key)] = float(bias)
    return tuple(sorted(pairs.items()))


def check_logit_bias(sampling: Sampling, vocab_size: int) -> None:
    """400 when ``logit_bias`` names a token id the model does not have (its logits' width)."""
    unknown = [t for t, _ in sampling.logit_bias if t >= vocab_size]
    if unknown:
        raise ApiError(400, f"logit_bias names token id {unknown[0]}, which the model does not have (its vocabulary "
                            f"is ids 0 to {vocab_size - 1})", param="logit_bias", code="invalid_value")


# ------------------------------------------------------------------------------ prompts
PLAIN_TEMPLATE_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def plain_chat_prompt(messages: tuple[tuple[str, str], ...]) -> str:
    """The documented template for a tokenizer without a chat template: one ``Role: text`` line
    per message, then ``Assistant:`` where the answer starts (docs/serving.md)."""
    lines = [f"{PLAIN_TEMPLATE_ROLES[role]}: {text}\n" for role, text in messages]
    return "".join(lines) + "Assistant:"


class StopText:
    """Cuts a stream of text at the first of the ``stop`` strings (excluded, as OpenAI does).

    Text that could still become a stop string is held back until it cannot, so a stop string
    split over several tokens never reaches the client in part."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        """What may be sent now; sets ``hit`` once a stop string appeared (nothing after it is sent)."""
        if self.hit:
            return ""
        text = self._held + piece
        if not self.stop:
            return text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._held = True, ""
            return text[:cut]
        keep = max((k for s in self.stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, once the text has ended without a stop string."""
        out, self._held = ("" if self.hit else self._held), ""
        return out


# ------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(kind: Kind, request_id: str, model: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The whole answer of a request that did not stream."""
    if kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}


def chunk_body(kind: Kind, request_id: str, model: str, created: int, *, text: str | None = None,
               finish_reason: str | None = None, first: bool = False,
               usage_counts: tuple[int, int] | None = None) -> dict[str, Any]:
    """One server-sent event of a stream: a piece of text, the end (``finish_reason``), or, with
    ``stream_options.include_usage``, the last chunk holding only the usage."""
    if kind == "completion":
        obj = "text_completion"
        choices = [] if usage_counts else [{"index": 0, "text": text or "", "logprobs": None,
                                            "finish_reason": finish_reason}]
    else:
        obj = "chat.completion.chunk"
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [] if usage_counts else [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish_reason}]
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices,
           "system_fingerprint": None}
    if usage_counts is not None:
        out["usage"] = usage(*usage_counts)
    return out


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_body(model, created)]}


def model_body(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "edgeshard"}


def now_s() -> int:
    return int(time.time())
