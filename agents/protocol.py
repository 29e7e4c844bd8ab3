"""The base wire format between coordinator and agents; technique rooms add their own messages,
options and data kinds through ``agents.registry``, decoded by the same total decoder here.

Messages are versioned ``msgspec.Struct``s decoded strictly; tensors travel as raw
frames beside a small header (dtype, shape), never pickled. ``TimelineEvent`` is also
what the simulator predicts and what the SessionStore records, so live, predicted and
replayed timelines are drawn from one type. The version, the errors and the message base
live in ``agents.envelope`` (re-exported here), profiling's messages in
``agents.profiling_protocol``.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, Union, get_args

import msgspec

from agents import registry
from agents.accelerators import device_name_problem
from agents.weight_precision import PRECISIONS as WEIGHT_PRECISIONS
from agents.envelope import (  # noqa: F401  (the base protocol's public names, re-exported)
    MAX_CONTROL_FRAME,
    MAX_LOGIT_BIAS,
    MAX_NEW_TOKENS,
    MAX_ROWS,
    MAX_SOCKET_MESSAGE,
    MAX_STAGES,
    MAX_THREADS,
    MAX_TIMEOUT_S,
    NO_OPTIONS,
    PROTOCOL_VERSION,
    Phase,
    UPGRADE_HINT,
    KvReservation,
    LinkShape,
    Message,
    Options,
    PeerSpec,
    ProtocolError,
    SamplingSpec,
    VersionMismatch,
    finite,
    is_data_address,
    options_of,
    options_problem,
    options_slot,
    peer_problem,
    reason,
    registered_decoder,
    sampling_problem,
    short,
)
from agents.data_frames import (  # noqa: F401
    DTYPE_SIZES,
    MAX_DATA_TENSORS,
    MAX_DIM,
    DataHeader,
    DataKind,
    TensorSpec,
    decode_data,
    encode_data_header,
)
from agents.profiling_protocol import (  # noqa: F401
    DEFAULT_HEADROOM_BYTES,
    RESULT_OF,
    ComputeOptions,
    ComputeProfile,
    ConvSweepOptions,
    ConvTimings,
    LinkOptions,
    LinkResult,
    MeasureLink,
    ProfileCompute,
    ProfileOptions,
    ProfileOutcome,
    ProfileResult,
    UnitTimes,
)

EventKind = Literal["compute", "send", "recv_wait", "io", "failure", "replan", "reload", "draft", "rollback"]
"""compute: a stage running its units; send: putting an activation (or token ids) on a
link, ``peer`` is the receiver; recv_wait: a stage idle waiting for its input; io: a stage
reading weights from its storage, on the lane ``storage_lane(device)`` (``peer`` may say what
was read and what happened, in the stage kind's own words; a buffer hit or an eviction is a
zero-length io event). The coordinator adds a recovery's: failure (on the lost
device's lane, from the last work heard of it to its detection), replan (the re-plan) and
reload (on each new stage's lane, loading its shard). Speculative decoding's: draft (the source
proposing a trip's tokens with its draft model; ``nbytes``: the tokens proposed) and rollback (a
stage rewinding its KV cache past rejected proposals; ``nbytes``: the positions dropped)."""


def storage_lane(device: str) -> str:
    """The timeline lane of a device's storage reads (``io`` events)."""
    return f"{device}:storage"


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


class AgentState(enum.StrEnum):
    """What an agent is doing (``AgentStatus.state``, ``Pong.state``), encoded as its string.

    A value outside these is a decode error, not a string nobody compares against; the
    strings are what the studio shows (a StrEnum compares equal to them)."""

    IDLE = "idle"
    """No shard loaded."""
    LOADING = "loading"
    READY = "ready"
    """A shard is loaded; a run can start."""
    RUNNING = "running"
    FAILED = "failed"
    """The last load failed; ``AgentStatus.error`` says why."""


class Ping(Message, frozen=True, tag="ping"):
    """Heartbeat and clock probe: ``t0`` is the coordinator's send time."""

    t0: float = 0.0


class Pong(Message, frozen=True, tag="pong"):
    t0: float
    t1: float
    """Agent clock when the ping arrived."""
    t2: float
    """Agent clock when the pong left."""
    state: AgentState = AgentState.IDLE


class GetStatus(Message, frozen=True, tag="get_status"):
    pass


class WireCount(msgspec.Struct, frozen=True, kw_only=True):
    """Messages and bytes an agent's sockets were handed on one link for one kind, since it started
    (``agents.transport.WireCounts``): headers included, as sent."""

    link: str
    """The peer device, or ``coordinator`` for control replies."""
    kind: str
    """A data frame's kind, or a control message's tag."""
    messages: int
    nbytes: int


class Accelerator(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A CUDA device an agent can place a stage on (``LoadShard.torch_device``)."""

    name: str
    """``cuda:N``."""
    model: str
    memory_bytes: int


class AgentStatus(Message, frozen=True, tag="status"):
    device: str
    agent_version: str
    state: AgentState
    public_key: str
    data_address: str
    stage: int = -1
    units: tuple[int, int] = (0, 0)
    memory_bytes: int = 0
    kv_reserved_bytes: int = 0
    """KV cache the loaded stage allocated at load (``LoadShard.kv``), beside its weights' ``memory_bytes``."""
    kv_bytes: int = 0
    """KV cache its live micro-batches hold now (a finished or left one's is dropped at once)."""
    error: str = ""
    pid: int = 0
    activity: str = ""
    """What the worker is doing now (e.g. ``loading units [0, 3)``, ``profiling compute``); empty when idle."""
    progress: float = 0.0
    """Fraction of ``activity`` done (0..1) where it can tell (loading: blocks read)."""
    held_by: str = ""
    """Whose the agent's run, session or loaded stage is, seen by the asker: ``you``, ``another
    coordinator`` or "" (none). An agent serves one coordinator's work at a time."""
    holder_silent_s: float = 0.0
    """Seconds since that coordinator last sent anything (its pings renew a run's lease)."""
    wire_sent: tuple[WireCount, ...] = ()
    """What the agent's sockets sent since it started, per link and kind (a run's share: the
    difference of two statuses, ``core.runs.wire``)."""
    accelerators: tuple[Accelerator, ...] = ()
    """The CUDA devices torch sees on the agent (empty: it computes on its CPU only)."""


class LoadShard(Message, frozen=True, tag="load_shard"):
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
    options: msgspec.Raw = NO_OPTIONS
    """The stage kind's own options (an ``Options`` struct of a registered technique, e.g. the
    agents its stage calls over the data plane while it computes); nil: none. Decoded and
    range-checked with the frame (``options_of``)."""
    weights: str = "fp"
    """The precision of the stage's block weights: ``fp`` (``dtype``), ``int8`` or ``int4``
    (weight-only, quantized at load: agents.weight_precision)."""
    torch_device: str = "cpu"
    """Where the stage computes: ``cpu``, ``cuda`` or ``cuda:N`` (agents.accelerators; not ``device``:
    the peers' ``device`` is the agent's name)."""

    def problem(self) -> str:
        if device_name_problem(self.torch_device):
            return device_name_problem(self.torch_device)
        if self.weights not in WEIGHT_PRECISIONS:
            return f"weights must be one of {', '.join(WEIGHT_PRECISIONS)}, got {short(self.weights)}"
        if not 0 <= self.threads <= MAX_THREADS:
            return f"threads must be in [0, {MAX_THREADS}], got {self.threads}"
        if not 0 <= self.start < self.end:
            return f"units must be a non-empty range [start, end), got [{self.start}, {self.end})"
        if not self.peers or len(self.peers) > MAX_STAGES:
            return f"peers must list 1..{MAX_STAGES} stages"
        stages = sorted(p.stage for p in self.peers)
        if stages != list(range(len(stages))):
            return f"peers must be stages 0..{len(stages) - 1} once each, got {stages}"
        if not 0 <= self.stage < len(self.peers):
            return f"stage must be in [0, {len(self.peers)}), got {self.stage}"
        for p in self.peers:
            problem = peer_problem(p)
            if problem:
                return problem
        if self.dtype not in DTYPE_SIZES:
            return f"dtype must be one of {', '.join(DTYPE_SIZES)}, got {short(self.dtype)}"
        link = self.link
        if not (finite(link.bandwidth_mbit_s, 0, 1e6) and finite(link.latency_ms, 0, 60_000)):
            return "link bandwidth must be in [0, 1e6] Mbit/s and latency in [0, 60000] ms"
        return options_problem(self.options)


class QueryWeights(Message, frozen=True, tag="query_weights"):
    """How much of each file (by sha256) the agent holds; answered by ``WeightsHeld``."""

    digests: tuple[str, ...]


class WeightsHeld(Message, frozen=True, tag="weights_held"):
    held: tuple[int, ...]
    """Bytes held per digest asked (complete: the file's size; partial: where to resume)."""


class PutWeights(Message, frozen=True, tag="put_weights"):
    """``data`` at ``offset`` of the file ``digest`` (``size`` bytes in all); the agent
    checks the sha256 when the last byte arrives. Answered by ``WeightsHeld`` (one entry)."""

    digest: str
    offset: int
    size: int
    data: bytes


class Unload(Message, frozen=True, tag="unload"):
    pass


class StartRun(Message, frozen=True, tag="start_run"):
    """Begin a run. Only the source (stage 0) gets the prompts' token ids — and the last stage
    too when its sampler needs them (``SamplingSpec.uses_history``: a repetition penalty or an
    n-gram ban looks at every token of a sequence, the prompt's included, as HF's does)."""

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
    lease_s: float = 0.0
    """The run is leased to the coordinator that started it: when nothing arrives from it for
    this long (its pings renew the lease), the agent aborts the run and returns to ready.
    0 = no lease (kept for peers that do not ping)."""
    first_steps: tuple[int, ...] = ()
    """Per micro-batch, the decode step of the whole generation this run's prefill produces
    the token of (a run that resumes an interrupted one; empty: every micro-batch starts at
    0). The last stage keys its sampler by it, so sampling continues where it stopped."""
    micro_batch_keys: tuple[int, ...] = ()
    """Per micro-batch, the key of its sampler (empty: its index): a resumed run keeps the
    interrupted run's keys even when finished micro-batches are left out."""
    generated: tuple[tuple[int, ...], ...] = ()
    """Per sequence, the tokens an interrupted run already produced (source only; empty: none).
    ``input_ids`` then already end with them, as the prefill that rebuilds the KV cache."""
    options: msgspec.Raw = NO_OPTIONS
    """A registered technique's run options (source only): a run whose options have a run driver
    (``registry.run_driver_for``) is scheduled by that driver; nil: the plan's stages as usual."""

    def problem(self) -> str:
        problem = sampling_problem(self.sampling)
        if problem:
            return problem
        if not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            return f"max_new_tokens must be in [0, {MAX_NEW_TOKENS}], got {self.max_new_tokens}"
        if not finite(self.lease_s, 0, MAX_TIMEOUT_S):
            return f"lease_s must be in [0, {MAX_TIMEOUT_S:.0f}], got {self.lease_s!r}"
        rows = len(self.input_ids)
        if rows > MAX_ROWS or len(self.attention_mask) != rows:
            return f"input_ids and attention_mask must have the same rows (at most {MAX_ROWS})"
        if any(len(a) != len(b) for a, b in zip(self.input_ids, self.attention_mask)):
            return "each attention_mask row must be as long as its input_ids row"
        if len({len(r) for r in self.input_ids}) > 1:
            return "input_ids rows must be padded to one length"
        seen = sorted(i for mb in self.micro_batches for i in mb)
        if rows and seen != list(range(rows)):
            return f"micro_batches must cover sequences 0..{rows - 1} once each"
        if any(not mb for mb in self.micro_batches):
            return "micro_batches must not be empty"
        for name, per_mb in (("first_steps", self.first_steps), ("micro_batch_keys", self.micro_batch_keys)):
            if len(per_mb) > MAX_ROWS or any(not 0 <= v <= MAX_NEW_TOKENS for v in per_mb):
                return f"{name} must hold at most {MAX_ROWS} values in [0, {MAX_NEW_TOKENS}]"
        if self.generated and (len(self.generated) != rows
                               or any(len(g) > MAX_NEW_TOKENS or any(not 0 <= t < 1 << 31 for t in g)
                                      for g in self.generated)):
            return f"generated must hold one row of token ids per sequence ({rows}), each at most {MAX_NEW_TOKENS}"
        return options_problem(self.options)


class StopRun(Message, frozen=True, tag="stop_run"):
    """Abort the run (if any), drop its caches, go back to ready."""

    run_id: str = ""
    """The run to stop; empty: whatever run is current. A stop naming an earlier run is
    answered but stops nothing (it must never end the run that followed)."""


class GetLogs(Message, frozen=True, tag="get_logs"):
    lines: int = 200

    def problem(self) -> str:
        return "" if 0 <= self.lines <= 100_000 else f"lines must be in [0, 100000], got {self.lines}"


class Logs(Message, frozen=True, tag="logs"):
    lines: tuple[str, ...]


class Ok(Message, frozen=True, tag="ok"):
    detail: str = ""


class ErrorReply(Message, frozen=True, tag="error"):
    """Every request that cannot be served gets one; the agent stays up."""

    code: str
    """bad_frame | too_large | bad_version | bad_message | bad_state | failed | busy (the agent
    serves another run or session, or holds another coordinator's stage: the message says which,
    whose and how it ends) | over_budget
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


class EventBatch(Message, frozen=True, tag="events"):
    """Timeline events streamed during a run (flushed about every 50 ms)."""

    run_id: str
    device: str
    stage: int
    events: tuple[AgentEvent, ...]


class TokensProduced(Message, frozen=True, tag="tokens"):
    """Sampled tokens of one micro-batch at one step, as the source received them."""

    run_id: str
    micro_batch: int
    step: int
    sequence_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    t: float
    """Agent clock at receipt."""


class RunFinished(Message, frozen=True, tag="run_finished"):
    run_id: str
    tokens: tuple[tuple[int, ...], ...]
    """Generated ids per sequence (up to and including EOS)."""


class RunError(Message, frozen=True, tag="run_error"):
    run_id: str
    device: str
    message: str


class LogLine(Message, frozen=True, tag="log"):
    line: str


BASE_MESSAGES: tuple[type, ...] = (
    Ping, Pong, GetStatus, AgentStatus, LoadShard, Unload, StartRun, StopRun, GetLogs, Logs,
    ProfileCompute, MeasureLink, ProfileResult, Ok, ErrorReply, EventBatch, TokensProduced,
    RunFinished, RunError, LogLine, QueryWeights, WeightsHeld, PutWeights,
)  # fmt: skip
"""The shared protocol's control messages; registered techniques add theirs (``registry``)."""

ControlMessage = Union[BASE_MESSAGES]  # type: ignore[valid-type]
"""The base messages' union (for typing); the decoder's union also holds the registered ones."""


class _Head(msgspec.Struct):
    v: Any = None
    type: Any = None
    req: Any = None


_head_decoder = msgspec.msgpack.Decoder(_Head)
_encoder = msgspec.msgpack.Encoder()
def encode_control(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_control(frame: bytes, max_size: int = MAX_CONTROL_FRAME) -> Message:
    """Decode one control frame strictly, or raise ``ProtocolError`` with a reply code: a base message
    or a registered technique's, its fields and options range-checked (``problem``)."""
    if len(frame) > max_size:
        raise ProtocolError("too_large", f"control frame of {len(frame)} bytes exceeds {max_size}")
    try:
        head = _head_decoder.decode(frame)
    except Exception as err:  # any bytes: invalid UTF-8 and deep nesting raise other types than msgspec's
        raise ProtocolError("bad_frame", f"not a msgpack map: {reason(err)}") from None
    req = head.req if type(head.req) is int and 0 <= head.req < 1 << 63 else 0
    if head.v != PROTOCOL_VERSION:
        raise VersionMismatch(head.v, req, f"protocol version {short(head.v)} received, version {PROTOCOL_VERSION} "
                                           f"supported here: {UPGRADE_HINT}")
    try:
        msg = registered_decoder("control", lambda: BASE_MESSAGES + registry.message_types()).decode(frame)
    except Exception as err:
        raise ProtocolError("bad_message", f"{short(head.type)}: {reason(err)}", req) from None
    try:
        problem = msg.problem()
    except ProtocolError as err:
        problem = str(err)
    if problem:
        raise ProtocolError("bad_message", f"{msg.type_name()}: {problem}", req)
    return msg


def message_problem(msg: Message) -> str:
    """What is out of range in a decoded message ("" when nothing): the one semantic check."""
    return msg.problem()
