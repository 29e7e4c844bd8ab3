"""The protocol's envelope: its version, its errors, the base of every control message, and the
vocabulary of range checks every message (shared or a technique's) is checked with.

One place for the version and the compatibility rules (``VersionMismatch``): the base protocol
(``agents.protocol``) and every technique's messages (``agents.techniques``) build on this
module, so a technique's structs are decoded and refused exactly as the shared ones are.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, Union

import msgspec

from agents import registry

PROTOCOL_VERSION = 8
"""Bumped whenever a message changes shape. 2: profiling options and results are typed structs
(they were free-form maps), ``AgentStatus.state`` / ``Pong.state`` one of ``AgentState``.
3: ``AgentStatus.held_by`` / ``holder_silent_s`` (one coordinator's work at a time).
4: ``ComputeProfile.cache_timing``.
5: technique-owned wire: ``LoadShard.options`` / ``StartRun.options`` / ``DataHeader.options``
(a technique's own ``Options`` struct, tagged by ``kind``) replace the four technique fields v4
had on those messages; a technique's control messages are its own (``agents.registry``); a
data frame's ``kind`` is a base kind or one a technique registered.
6: ``LoadShard.weights`` (the stage's weight precision: fp, int8, int4).
7: ``LoadShard.torch_device`` (cpu, cuda, cuda:N), ``AgentStatus.accelerators`` (its CUDA devices) and
``AgentStatus.wire_sent``.
8: ``SamplingSpec.frequency_penalty`` / ``presence_penalty`` / ``logit_bias`` (OpenAI's)."""

MAX_CONTROL_FRAME = 1 << 20
"""Largest control frame the agent decodes (1 MiB); bigger ones get an error reply."""
MAX_SOCKET_MESSAGE = 1 << 30
"""libzmq's own cut-off (ZMQ_MAXMSGSIZE): a peer sending more than this is disconnected
before the bytes reach Python, so a hostile frame cannot exhaust memory."""


class ProtocolError(Exception):
    """A frame that does not decode: carries an error ``code`` for the reply, and the frame's
    request id when it could be read (0 if not), so the refusal reaches the request waiting
    for it instead of leaving it to time out."""

    def __init__(self, code: str, message: str, req: int = 0):
        self.code = code
        self.req = req
        super().__init__(message)


UPGRADE_HINT = "upgrade the agent with `edgeshard agents upgrade` (it deploys the studio's own agent version)"


class VersionMismatch(ProtocolError):
    """A frame of another protocol version (code ``bad_version``): the peer runs other code.

    Carries what the receiver needs to answer in a way the peer can still read: the version
    received (``None`` when the frame named none) and the request id to echo (0 if none)."""

    def __init__(self, received: Any, req: int, message: str):
        self.received = received
        super().__init__("bad_version", message, req)

    @property
    def reply_version(self) -> int:
        """The version to answer in: an older peer's own (v1's ``ErrorReply`` has this shape, so an
        older coordinator reads the reason instead of dropping the reply), else ours."""
        r = self.received
        return r if type(r) is int and 1 <= r < PROTOCOL_VERSION else PROTOCOL_VERSION


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    """Every control message: its ``type`` tag, the protocol version ``v`` and the request id."""

    v: int = PROTOCOL_VERSION
    req: int = 0
    """Correlation id chosen by the coordinator; replies echo it, unsolicited messages use 0."""

    def type_name(self) -> str:
        return type(self).__struct_config__.tag

    def problem(self) -> str:
        """What is out of range in this decoded message ("" when nothing). A technique's message
        overrides it; the decoder calls it on every frame (``agents.protocol.decode_control``)."""
        return ""


Phase = Literal["prefill", "decode"]

NO_OPTIONS = msgspec.Raw(b"\xc0")
"""An empty options slot (msgpack nil): the message carries no technique's options."""


class Options(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
    """A technique's options on a shared message (``LoadShard.options``, ``StartRun.options``,
    ``DataHeader.options``): the shared message carries them as a typed slot the registry decodes
    (``agents.registry.options_of``), strictly, by their ``kind`` tag, like any control message."""

    def problem(self) -> str:
        """What is out of range ("" when nothing); checked whenever the slot is decoded."""
        return ""

    def data_keys(self) -> tuple[str, ...]:
        """Public keys of agents these options let send to this agent's data socket (a stage's
        services, beside its plan's peers)."""
        return ()


# --------------------------------------------------------------------------------------
# Field ranges: what decodes by type can still be nonsense (NaN, 10**6 threads, a peer
# address that is not tcp://host:port). Checked once per frame, for every control frame.
# --------------------------------------------------------------------------------------

MAX_THREADS = 1024
MAX_TIMEOUT_S = 3600.0
MAX_NEW_TOKENS = 1 << 20
MAX_STAGES = 4096
MAX_ROWS = 1 << 16
_ADDRESS = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]{1,253}):([0-9]{1,5})$")


def is_data_address(text: str) -> bool:
    """``tcp://host:port`` with a port in 1..65535 (what an agent can connect a PUSH socket to)."""
    m = _ADDRESS.match(text)
    return bool(m) and 1 <= int(m.group(2)) <= 65535


def finite(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def all_finite(values, lo: float = 0.0) -> bool:
    return all(math.isfinite(x) and x >= lo for x in values)


def ints_problem(name: str, values: tuple[int, ...], lo: int, hi: int, most: int, least: int = 1) -> str:
    if not least <= len(values) <= most or any(not lo <= x <= hi for x in values):
        return f"{name} must be {least}..{most} integers in [{lo}, {hi}], got {list(values)[:8]}"
    return ""


def float_tensor_problem(name: str, shape: tuple[int, ...], data: bytes, dims: int) -> str:
    """A float32 tensor sent as raw bytes: ``dims`` dimensions in range, bytes matching the shape."""
    if len(shape) != dims or any(not 1 <= d <= 1 << 20 for d in shape):
        return f"{name} shape must be {dims} dims in [1, 1048576], got {list(shape)[:8]}"
    if math.prod(shape) * 4 != len(data):
        return f"{name} holds {len(data)} bytes, shape {list(shape)} needs {math.prod(shape) * 4} (float32)"
    return ""


def reason(err: BaseException) -> str:
    """One line for a decode failure, whatever raised it."""
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return short(f"{type(err).__name__}: {err}" if not isinstance(err, msgspec.MsgspecError) else str(err), 200)


def short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PeerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of the loaded plan as its neighbours reach it."""

    device: str
    stage: int
    data_address: str
    """``tcp://host:port`` of the peer's data socket."""
    public_key: str
    """The peer's CurveZMQ public key (Z85, 40 chars)."""


def peer_problem(peer: PeerSpec) -> str:
    if not is_data_address(peer.data_address):
        return f"peer {peer.device!r}: data_address must be tcp://host:port, got {short(peer.data_address)}"
    if len(peer.public_key) != 40:
        return f"peer {peer.device!r}: public_key must be a 40-character Z85 key"
    if not 0 <= peer.stage < MAX_STAGES:
        return f"peer {peer.device!r}: stage must be in [0, {MAX_STAGES})"
    return ""


class LinkShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Emulated link applied in the sender's send path (0 = unshaped)."""

    bandwidth_mbit_s: float = 0.0
    latency_ms: float = 0.0


class KvReservation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """KV cache a stage allocates at load for the planned run (0 = none: it grows per token).

    As the paper's implementation does: memory is known before the first token, and a plan
    that does not fit fails at load, not mid-run."""

    groups: int = 0
    """Micro-batches in flight (each gets its own cache)."""
    sequences: int = 0
    """Sequences per micro-batch."""
    context_tokens: int = 0
    """Prompt + generated tokens a sequence may reach."""


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the last stage picks tokens; temperature 0 is greedy (agents/sampling.py)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    repetition_penalty: float = 1.0
    """HF's repetition_penalty (1 = off). With it, or an n-gram ban, the last stage is sent the
    prompts' token ids (``StartRun.input_ids``): the penalty looks at every token of a sequence."""
    no_repeat_ngram_size: int = 0
    """HF's no_repeat_ngram_size (0 = off)."""
    frequency_penalty: float = 0.0
    """OpenAI's frequency_penalty (0 = off): counts the tokens generated so far (agents/sampling.py)."""
    presence_penalty: float = 0.0
    """OpenAI's presence_penalty (0 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's logit_bias as (token id, bias) pairs."""

    @property
    def uses_history(self) -> bool:
        """Whether the sampler needs each sequence's tokens so far."""
        return (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or self.frequency_penalty != 0
                or self.presence_penalty != 0)


def sampling_problem(s: SamplingSpec) -> str:
    """Every sampling field in range (a finite temperature in [0, 100], top_p in (0, 1], ...)."""
    if not finite(s.temperature, 0, 100):
        return f"sampling.temperature must be a finite number in [0, 100], got {s.temperature!r}"
    if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        return f"sampling.top_p must be in (0, 1], got {s.top_p!r}"
    if s.top_k < 0 or not 0 <= s.seed < 1 << 63:
        return "sampling.top_k must be >= 0 and sampling.seed in [0, 2**63)"
    if not finite(s.repetition_penalty, 0, 100) or s.repetition_penalty == 0:
        return f"sampling.repetition_penalty must be a finite number in (0, 100], got {s.repetition_penalty!r}"
    if not 0 <= s.no_repeat_ngram_size <= 64:
        return f"sampling.no_repeat_ngram_size must be in [0, 64], got {s.no_repeat_ngram_size}"
    if not (finite(s.frequency_penalty, -2, 2) and finite(s.presence_penalty, -2, 2)):
        return "sampling.frequency_penalty and sampling.presence_penalty must be finite numbers in [-2, 2]"
    if len(s.logit_bias) > MAX_LOGIT_BIAS or any(not 0 <= t < 1 << 31 or not finite(b, -100, 100)
                                                for t, b in s.logit_bias):
        return f"sampling.logit_bias must hold at most {MAX_LOGIT_BIAS} (token id >= 0, bias in [-100, 100]) pairs"
    return ""


MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries a request may give (the server refuses more at its entrance)."""


_DECODERS: dict[str, tuple[int, Any]] = {}
"""Decoders built from the registrations (``control``, ``options``), with the registry generation
they were built at: a registration rebuilds them."""


def registered_decoder(name: str, types):
    """The decoder of the union of ``types()`` (None when empty), built again only when a
    registration changed since."""
    built = _DECODERS.get(name)
    gen = registry.generation()
    if built is None or built[0] != gen:
        union = types()
        built = (gen, msgspec.msgpack.Decoder(Union[union]) if union else None)  # type: ignore[valid-type]
        _DECODERS[name] = built
    return built[1]


# --------------------------------------------------------------------------------------
# Options slots: a registered technique's own struct on a shared message
# --------------------------------------------------------------------------------------


def options_slot(options: Options | None) -> msgspec.Raw:
    """The slot value carrying ``options`` (None: an empty slot)."""
    return NO_OPTIONS if options is None else msgspec.Raw(msgspec.msgpack.encode(options))


def options_of(slot: msgspec.Raw) -> Options | None:
    """The options a slot carries, decoded strictly by the registered options types (their ``kind``
    tag), or None for an empty slot. ``ProtocolError`` for options no registered technique owns or
    out of range (``Options.problem``)."""
    raw = bytes(slot)
    if raw == b"\xc0":
        return None
    decoder = registered_decoder("options", registry.option_types)
    if decoder is None:
        raise ProtocolError("bad_message", "options of a technique this agent does not run")
    try:
        options = decoder.decode(raw)
    except Exception as err:
        raise ProtocolError("bad_message", f"options: {reason(err)}") from None
    problem = options.problem()
    if problem:
        raise ProtocolError("bad_message", f"{type(options).__struct_config__.tag} options: {problem}")
    return options


def options_problem(slot: msgspec.Raw) -> str:
    try:
        options_of(slot)
    except ProtocolError as err:
        return str(err)
    return ""


def sampling_without_history_problem(s: SamplingSpec, refusal: str) -> str:
    """Sampling in range for a sampler that keeps no token history: ``refusal`` says why a repetition
    penalty or an n-gram ban is not served (nor are OpenAI's penalties and logit bias)."""
    if not finite(s.temperature, 0, 100) or not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        return "sampling.temperature must be in [0, 100] and sampling.top_p in (0, 1]"
    if s.top_k < 0 or not 0 <= s.seed < 1 << 63:
        return "sampling.top_k must be >= 0 and sampling.seed in [0, 2**63)"
    if s.frequency_penalty != 0 or s.presence_penalty != 0 or s.logit_bias:
        return ("this technique samples without frequency or presence penalties or a logit bias (not supported): "
                "run with them off")
    if s.uses_history:
        return refusal
    return ""
