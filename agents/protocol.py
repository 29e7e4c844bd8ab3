"""The one definition of the wire format between coordinator and agents.

Messages are versioned ``msgspec.Struct``s decoded strictly; tensors travel as raw
frames beside a small header (dtype, shape), never pickled. ``TimelineEvent`` is also
what the simulator predicts and what the SessionStore records, so live, predicted and
replayed timelines are drawn from one type.
"""

from __future__ import annotations

from typing import Any, Literal, Union, get_args

import msgspec

PROTOCOL_VERSION = 1

EventKind = Literal["compute", "send", "recv_wait"]
"""compute: a stage running its units; send: putting an activation (or token ids) on a
link, ``peer`` is the receiver; recv_wait: a stage idle waiting for its input."""

Phase = Literal["prefill", "decode"]

RunMode = Literal["sequential", "bubbles", "no-bubbles"]
"""How the source schedules micro-batches (see ``agents.schedule``). Defined here, once: the wire
format owns the names; the coordinator, simulator, CLI and GUI import them."""
RUN_MODES: tuple[str, ...] = get_args(RunMode)


class TimelineEvent(msgspec.Struct, frozen=True, kw_only=True, array_like=False):
    """One box on the pipeline timeline.

    Times are seconds on the coordinator's clock, relative to the run's start (agents'
    own clocks are mapped through the estimated offset before events are stored).
    ``step`` is 0 for prefill and k for the k-th decode step.
    """

    device: str
    stage: int
    kind: EventKind
    phase: Phase
    step: int
    micro_batch: int
    start_s: float
    end_s: float
    nbytes: int = 0
    peer: str = ""
    clock_uncertainty_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens produced at one step for one micro-batch, as the source received them."""

    micro_batch: int
    step: int
    sequence_ids: tuple[int, ...]
    """Global index of each sequence (prompt) in the run."""
    token_ids: tuple[int, ...]
    text: tuple[str, ...] = ()
    """Decoded text piece per sequence (filled by the coordinator, which has the tokenizer)."""
    t_s: float = 0.0


# --------------------------------------------------------------------------------------
# Control messages (coordinator <-> agent, over the CurveZMQ control socket)
#
# A control frame is one msgpack map with a ``type`` tag and a protocol version ``v``.
# Decoding is two-step: a tolerant peek at (v, type) so a wrong version gets a precise
# error reply, then a strict decode against the tagged union (unknown fields, wrong
# types and unknown tags are errors). Nothing is ever unpickled or eval'd.
# --------------------------------------------------------------------------------------

MAX_CONTROL_FRAME = 1 << 20
"""Largest control frame the agent decodes (1 MiB); bigger ones get an error reply."""
MAX_SOCKET_MESSAGE = 1 << 30
"""libzmq's own cut-off (ZMQ_MAXMSGSIZE): a peer sending more than this is disconnected
before the bytes reach Python, so a hostile frame cannot exhaust memory."""


class ProtocolError(Exception):
    """A frame that does not decode: carries an error ``code`` for the reply."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    req: int = 0
    """Correlation id chosen by the coordinator; replies echo it, unsolicited messages use 0."""


class PeerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of the loaded plan as its neighbours reach it."""

    device: str
    stage: int
    data_address: str
    """``tcp://host:port`` of the peer's data socket."""
    public_key: str
    """The peer's CurveZMQ public key (Z85, 40 chars)."""


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
    """How the last stage picks tokens; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


class Ping(_Msg, frozen=True, tag="ping"):
    """Heartbeat and clock probe: ``t0`` is the coordinator's send time."""

    t0: float = 0.0


class Pong(_Msg, frozen=True, tag="pong"):
    t0: float
    t1: float
    """Agent clock when the ping arrived."""
    t2: float
    """Agent clock when the pong left."""
    state: str = "idle"


class GetStatus(_Msg, frozen=True, tag="get_status"):
    pass


class AgentStatus(_Msg, frozen=True, tag="status"):
    device: str
    agent_version: str
    state: str
    """idle | loading | ready | running | failed"""
    public_key: str
    data_address: str
    stage: int = -1
    units: tuple[int, int] = (0, 0)
    memory_bytes: int = 0
    kv_reserved_bytes: int = 0
    """KV cache the loaded stage allocated at load (``LoadShard.kv``), beside its weights' ``memory_bytes``."""
    error: str = ""
    pid: int = 0
    activity: str = ""
    """What the worker is doing now (e.g. ``loading units [0, 3)``, ``profiling compute``); empty when idle."""
    progress: float = 0.0
    """Fraction of ``activity`` done (0..1) where it can tell (loading: blocks read)."""


class LoadShard(_Msg, frozen=True, tag="load_shard"):
    """Load units [start, end) of the checkpoint at ``model_dir`` for stage ``stage``."""

    model_dir: str
    stage: int
    start: int
    end: int
    peers: tuple[PeerSpec, ...]
    """Every stage of the plan in order (this agent's entry included)."""
    dtype: str = "float32"
    threads: int = 0
    link: LinkShape = LinkShape()
    """Emulation for this agent's outgoing data link (to the next stage)."""
    kind: str = "layers"
    """The stage's kind: which technique's executor runs it (agents.executors)."""
    kv: KvReservation = KvReservation()
    """KV cache to allocate at load (agents.shard); the default reserves nothing."""
    files: tuple[tuple[str, str], ...] = ()
    """(file name, sha256) of weights sent with ``PutWeights``: load those (``model_dir``
    is then only a label); empty: load ``model_dir`` as it is on the device."""


class QueryWeights(_Msg, frozen=True, tag="query_weights"):
    """How much of each file (by sha256) the agent holds; answered by ``WeightsHeld``."""

    digests: tuple[str, ...]


class WeightsHeld(_Msg, frozen=True, tag="weights_held"):
    held: tuple[int, ...]
    """Bytes held per digest asked (complete: the file's size; partial: where to resume)."""


class PutWeights(_Msg, frozen=True, tag="put_weights"):
    """``data`` at ``offset`` of the file ``digest`` (``size`` bytes in all); the agent
    checks the sha256 when the last byte arrives. Answered by ``WeightsHeld`` (one entry)."""

    digest: str
    offset: int
    size: int
    data: bytes


class Unload(_Msg, frozen=True, tag="unload"):
    pass


class StartRun(_Msg, frozen=True, tag="start_run"):
    """Begin a run. Only the source (stage 0) gets the prompts' token ids."""

    run_id: str
    mode: RunMode
    max_new_tokens: int
    micro_batches: tuple[tuple[int, ...], ...] = ()
    """Sequence indices of each micro-batch (source only)."""
    input_ids: tuple[tuple[int, ...], ...] = ()
    """Left-padded prompt token ids, one row per sequence (source only)."""
    attention_mask: tuple[tuple[int, ...], ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    sampling: SamplingSpec = SamplingSpec()


class StopRun(_Msg, frozen=True, tag="stop_run"):
    """Abort the run (if any), drop its caches, go back to ready."""

    run_id: str = ""
    """The run to stop; empty: whatever run is current. A stop naming an earlier run is
    answered but stops nothing (it must never end the run that followed)."""


class GetLogs(_Msg, frozen=True, tag="get_logs"):
    lines: int = 200


class Logs(_Msg, frozen=True, tag="logs"):
    lines: tuple[str, ...]


class ProfileCompute(_Msg, frozen=True, tag="profile_compute"):
    """Measure this device's compute; ``options`` go to ``agents.profiler.profile_compute``."""

    options: dict[str, Any] = {}


class MeasureLink(_Msg, frozen=True, tag="measure_link"):
    """Measure the data link to ``peer``; handled by ``agents.profiler.measure_link``."""

    peer: PeerSpec
    options: dict[str, Any] = {}


class ProfileResult(_Msg, frozen=True, tag="profile_result"):
    result: dict[str, Any]


class Ok(_Msg, frozen=True, tag="ok"):
    detail: str = ""


class ErrorReply(_Msg, frozen=True, tag="error"):
    """Every request that cannot be served gets one; the agent stays up."""

    code: str
    """bad_frame | too_large | bad_version | bad_message | bad_state | failed | over_budget
    (a shard beyond the device's emulated memory budget, agents/emulation.py) | bad_weights
    (a weights chunk or file list that cannot be stored or loaded, agents/weights.py)"""
    message: str


class AgentEvent(msgspec.Struct, frozen=True, array_like=True):
    """A timeline event on the agent's clock (compact: array-encoded on the wire)."""

    kind: str
    phase: str
    step: int
    micro_batch: int
    start: float
    end: float
    nbytes: int = 0
    peer: str = ""


class EventBatch(_Msg, frozen=True, tag="events"):
    """Timeline events streamed during a run (flushed about every 50 ms)."""

    run_id: str
    device: str
    stage: int
    events: tuple[AgentEvent, ...]


class TokensProduced(_Msg, frozen=True, tag="tokens"):
    """Sampled tokens of one micro-batch at one step, as the source received them."""

    run_id: str
    micro_batch: int
    step: int
    sequence_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    t: float
    """Agent clock at receipt."""


class RunFinished(_Msg, frozen=True, tag="run_finished"):
    run_id: str
    tokens: tuple[tuple[int, ...], ...]
    """Generated ids per sequence (up to and including EOS)."""


class RunError(_Msg, frozen=True, tag="run_error"):
    run_id: str
    device: str
    message: str


class LogLine(_Msg, frozen=True, tag="log"):
    line: str


ControlMessage = Union[
    Ping, Pong, GetStatus, AgentStatus, LoadShard, Unload, StartRun, StopRun, GetLogs, Logs,
    ProfileCompute, MeasureLink, ProfileResult, Ok, ErrorReply, EventBatch, TokensProduced,
    RunFinished, RunError, LogLine, QueryWeights, WeightsHeld, PutWeights,
]  # fmt: skip


class _Head(msgspec.Struct):
    v: Any = None
    type: Any = None


_head_decoder = msgspec.msgpack.Decoder(_Head)
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_encoder = msgspec.msgpack.Encoder()


def encode_control(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_control(frame: bytes, max_size: int = MAX_CONTROL_FRAME) -> ControlMessage:
    """Decode one control frame strictly, or raise ``ProtocolError`` with a reply code."""
    if len(frame) > max_size:
        raise ProtocolError("too_large", f"control frame of {len(frame)} bytes exceeds {max_size}")
    try:
        head = _head_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError("bad_frame", f"not a msgpack map: {err}") from None
    if head.v != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version", f"protocol version {head.v!r} not supported (this agent speaks {PROTOCOL_VERSION})"
        )
    try:
        return _control_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError("bad_message", f"{head.type!r}: {err}") from None


# --------------------------------------------------------------------------------------
# Data frames (stage -> stage activations, last stage -> source token ids)
#
# A data message is multipart: [header, tensor bytes, tensor bytes, ...]. The header
# names each tensor's dtype and shape; the receiver checks the byte counts match before
# viewing the bytes as a tensor (zero-copy, never pickled).
# --------------------------------------------------------------------------------------

DataKind = Literal["hidden", "tokens", "probe"]

MAX_DATA_TENSORS = 4
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1,
}  # fmt: skip


class TensorSpec(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class DataHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    run_id: str
    kind: DataKind
    phase: Phase
    step: int
    micro_batch: int
    sender: str
    tensors: tuple[TensorSpec, ...]
    """hidden: (activation, attention_mask on prefill); tokens: (ids,)."""
    t_sent: float = 0.0


_data_decoder = msgspec.msgpack.Decoder(DataHeader)


def encode_data_header(header: DataHeader) -> bytes:
    return _encoder.encode(header)


def decode_data(frames: list, max_bytes: int) -> tuple[DataHeader, list[memoryview]]:
    """Check a received data message and return its header and tensor buffers.

    Raises ``ProtocolError`` on anything malformed: the caller logs it and drops the
    message (a PULL socket has nobody to reply to).
    """
    if not frames:
        raise ProtocolError("bad_frame", "empty data message")
    raw = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
    if len(raw) > MAX_CONTROL_FRAME:
        raise ProtocolError("too_large", "data header too large")
    try:
        head = _head_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError("bad_frame", f"data header is not a msgpack map: {err}") from None
    if head.v != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"data protocol version {head.v!r} not supported")
    try:
        header = _data_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError("bad_message", f"data header: {err}") from None
    if len(header.tensors) > MAX_DATA_TENSORS or len(header.tensors) != len(frames) - 1:
        raise ProtocolError(
            "bad_message", f"header names {len(header.tensors)} tensors, message has {len(frames) - 1}"
        )
    bufs = []
    total = 0
    for spec, frame in zip(header.tensors, frames[1:]):
        if spec.dtype not in DTYPE_SIZES or any(d < 0 for d in spec.shape) or len(spec.shape) > 4:
            raise ProtocolError("bad_message", f"bad tensor spec {spec}")
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if buf.nbytes != spec.nbytes():
            raise ProtocolError("bad_message", f"tensor {spec} needs {spec.nbytes()} bytes, got {buf.nbytes}")
        total += buf.nbytes
        bufs.append(buf)
    if total > max_bytes:
        raise ProtocolError("too_large", f"data message of {total} bytes exceeds {max_bytes}")
    return header, bufs
