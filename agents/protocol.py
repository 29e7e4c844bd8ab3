"""The one definition of the wire format between coordinator and agents.

Messages are versioned ``msgspec.Struct``s decoded strictly; tensors travel as raw
frames beside a small header (dtype, shape), never pickled. ``TimelineEvent`` is also
what the simulator predicts and what the SessionStore records, so live, predicted and
replayed timelines are drawn from one type.
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any, Literal, Union, get_args

import msgspec

PROTOCOL_VERSION = 4
"""Bumped whenever a message changes shape. 2: profiling options and results are typed structs
(they were free-form maps), ``AgentStatus.state`` / ``Pong.state`` one of ``AgentState``.
3: ``AgentStatus.held_by`` / ``holder_silent_s`` (one coordinator's work at a time).
4: ``ComputeProfile.cache_timing``."""

EventKind = Literal["compute", "send", "recv_wait", "io", "failure", "replan", "reload"]
"""compute: a stage running its units; send: putting an activation (or token ids) on a
link, ``peer`` is the receiver; recv_wait: a stage idle waiting for its input; io: a stage
reading weights from its storage, on the lane ``storage_lane(device)`` (expert offloading:
``peer`` says which expert and what happened, ``expert_activity``; a buffer hit or an
eviction is a zero-length io event). The coordinator adds a recovery's: failure (on the lost
device's lane, from the last work heard of it to its detection), replan (the re-plan) and
reload (on each new stage's lane, loading its shard)."""


def storage_lane(device: str) -> str:
    """The timeline lane of a device's storage reads (``io`` events)."""
    return f"{device}:storage"


EXPERT_OUTCOMES = ("hit", "load", "preload", "evict")
"""What happened to an expert in an ``io`` event: found in the buffer, read on demand (a miss),
read ahead by the predictor, or evicted."""


def expert_activity(block: int, expert: int, outcome: str) -> str:
    """The ``peer`` of an expert's io event: ``expert BLOCK.EXPERT OUTCOME``."""
    return f"expert {block}.{expert} {outcome}"


def parse_expert_activity(peer: str) -> tuple[int, int, str] | None:
    """(block, expert, outcome) of an ``expert_activity`` peer; None for anything else."""
    parts = peer.split(" ")
    if len(parts) != 3 or parts[0] != "expert" or parts[2] not in EXPERT_OUTCOMES:
        return None
    block, _, expert = parts[1].partition(".")
    if not (block.isdigit() and expert.isdigit()):
        return None
    return int(block), int(expert), parts[2]

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


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    req: int = 0
    """Correlation id chosen by the coordinator; replies echo it, unsolicited messages use 0."""

    def type_name(self) -> str:
        return type(self).__struct_config__.tag


class PeerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of the loaded plan as its neighbours reach it."""

    device: str
    stage: int
    data_address: str
    """``tcp://host:port`` of the peer's data socket."""
    public_key: str
    """The peer's CurveZMQ public key (Z85, 40 chars)."""


class ServicePeer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An agent a stage calls while it computes, and the part [start, stop) it serves."""

    device: str
    data_address: str
    public_key: str
    start: int
    stop: int


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

    @property
    def uses_history(self) -> bool:
        """Whether the sampler needs each sequence's tokens so far."""
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0


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


class Ping(_Msg, frozen=True, tag="ping"):
    """Heartbeat and clock probe: ``t0`` is the coordinator's send time."""

    t0: float = 0.0


class Pong(_Msg, frozen=True, tag="pong"):
    t0: float
    t1: float
    """Agent clock when the ping arrived."""
    t2: float
    """Agent clock when the pong left."""
    state: AgentState = AgentState.IDLE


class GetStatus(_Msg, frozen=True, tag="get_status"):
    pass


class AgentStatus(_Msg, frozen=True, tag="status"):
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
    services: tuple[ServicePeer, ...] = ()
    """Other agents this stage calls over the data plane while it computes (attention
    offloading: the memory agents holding the KV of key/value heads [start, stop))."""


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


class StaggeredSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attention offloading with several compute replicas (agents.schedule.staggered_slices):
    ``schedule`` (fixed | rotational) and every replica's data plane, replica 0 first (the source)."""

    schedule: str
    replicas: tuple[PeerSpec, ...]


class StartRun(_Msg, frozen=True, tag="start_run"):
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
    staggered: StaggeredSpec | None = None
    """Attention offloading's staggered pipelining (source only): the run's micro-batches go over
    the replicas by ``agents.schedule.staggered_slices``; None: the plan's stages as usual."""


class StopRun(_Msg, frozen=True, tag="stop_run"):
    """Abort the run (if any), drop its caches, go back to ready."""

    run_id: str = ""
    """The run to stop; empty: whatever run is current. A stop naming an earlier run is
    answered but stops nothing (it must never end the run that followed)."""


class GetLogs(_Msg, frozen=True, tag="get_logs"):
    lines: int = 200


class Logs(_Msg, frozen=True, tag="logs"):
    lines: tuple[str, ...]


# Profiling: typed requests and results (agents/profiler.py measures, core/devices/profiling.py
# consumes). A request's options and a result are each a small tagged union (``kind``), so the
# coordinator decodes exactly the result it asked for and the agent range-checks what to measure
# before it starts (``message_problem``).

DEFAULT_HEADROOM_BYTES = 512 << 20
"""Memory a device keeps for its OS, the agent and activations (subtracted from its budget)."""


class ComputeOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                     tag_field="kind", tag="units"):
    """Time each unit of a model (``agents.profiler.profile_units``)."""

    config: dict[str, Any]
    """The model's HF config.json content (free-form by nature: transformers' ``AutoConfig``
    reads it on the agent; the protocol only checks that it names a ``model_type``)."""
    prompt_tokens: int = 32
    context_tokens: int = 0
    """KV-cache length for decode timing (0: prompt_tokens)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    """Decode batch sizes."""
    prefill_batch_sizes: tuple[int, ...] = (1,)
    """Prefill is timed for prompt_tokens × each of these sequences."""
    repeats: int = 5
    warmup: int = 2
    dtype: str = "float32"
    units: tuple[int, ...] = ()
    """Units to time (empty: all)."""
    threads: int = 0
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    seed: int = 0
    device: str = "cpu"
    """Where the agent's runtime computes ("cpu", or "cuda[:N]" on a GPU device); timing and
    the memory budget follow it (the stage executor runs on the CPU today)."""


class ConvSweepOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                       tag_field="kind", tag="conv-sweep"):
    """Time 3×3 convolutions over map sizes (spatial partitioning, ``agents.spatial.conv_sweep``).
    Bounded (``message_problem``) so a request cannot keep an agent busy for hours."""

    sizes: tuple[int, ...] = (8, 16, 24, 32, 48, 64)
    """Map sizes, 1..12 of them in [4, 256]."""
    channels: tuple[int, ...] = (16, 32)
    """Channel counts, 1..6 of them in [1, 512]."""
    repeats: int = 5
    """1..20"""
    threads: int = 0


ProfileOptions = Union[ComputeOptions, ConvSweepOptions]


class LinkOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a ``MeasureLink`` does. The coordinator sends the same probe id to the receiver
    (role "receive", peer = the sender) and the sender (role "send")."""

    role: Literal["send", "receive"]
    probe_id: str = "probe"
    nbytes: int = 1 << 20
    chunk_bytes: int = 64 << 10
    latency_probes: int = 10
    latency_gap_s: float = 0.005
    timeout_s: float = 60.0
    warmup_fraction: float = 0.2
    """Bytes at the start that only open the TCP window (not counted)."""


class UnitTimes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One unit's median times: ``decode_s`` per decode batch size, ``prefill_s`` per prefill
    token count (the profile's lists, in order); spreads are IQR / median."""

    unit: int
    decode_s: tuple[float, ...]
    decode_spread: tuple[float, ...]
    prefill_s: tuple[float, ...]
    prefill_spread: tuple[float, ...]
    param_bytes: int
    expert_decode_s: float = 0.0
    """A MoE block's one expert on one token (median), so a planner can split the block's decode
    time into its non-expert part and ``top_k`` experts; 0 for a unit without experts."""


class ComputeProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                     tag_field="kind", tag="units"):
    """What a device measured for ``ComputeOptions``."""

    device: str
    decode_batch_sizes: tuple[int, ...]
    prefill_token_counts: tuple[int, ...]
    units: tuple[UnitTimes, ...]
    memory_budget_bytes: int
    memory_total_bytes: int
    memory_available_bytes: int
    accelerator: str
    threads: int
    seconds: float
    arch: str = ""
    cores: int = 0
    stage_decode_overhead_s: float = 0.0
    """Once per stage and decode step (smallest decode batch): mask, positions, rotary."""
    stage_prefill_overhead_s: float = 0.0
    """Once per stage and prefill (first prefill batch): the same plus a fresh KV cache."""
    emulation: str = ""
    """The emulated limits already applied to these figures (agents/emulation.py); empty: none."""
    cache_timing: str = ""
    """"cold": the units' weights were out of the CPU's last-level cache at each timed call, as a run
    finds them; "warm: WHY": (some) were in it (agents/cold_profiling.py); empty: not recorded."""


class ConvTimings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                  tag_field="kind", tag="conv-sweep"):
    """What a device measured for ``ConvSweepOptions``: (FLOPs, seconds) per convolution and per
    FC layer (the head is bound by reading weights, so it gets its own fit), scaled by its
    emulated slowdown."""

    samples: tuple[tuple[float, float], ...]
    fc_samples: tuple[tuple[float, float], ...] = ()
    layer_samples: tuple[tuple[float, float, float, float], ...] = ()
    """(FLOPs, weight bytes, activation bytes, seconds) per timed layer strip (``agents.spatial.
    layer_timing_samples``: the swept convs, narrow strips, small maps with many channels, pools),
    for the per-layer model y = a·FLOPs + b + weight and activation bytes terms; empty from an
    agent that does not time them."""


class LinkResult(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                 tag_field="kind", tag="link"):
    """One side of a link probe (``LinkOptions``); the receiver's carries the figures."""

    role: Literal["send", "receive"]
    probe_id: str
    bytes_received: int = 0
    bandwidth_mbit_s: float = 0.0
    one_way_s: tuple[float, ...] = ()
    """receiver clock at arrival minus sender clock at send, per latency probe."""
    seconds: float = 0.0
    error: str = ""


ProfileOutcome = Union[ComputeProfile, ConvTimings, LinkResult]

RESULT_OF: dict[type, type] = {
    ComputeOptions: ComputeProfile, ConvSweepOptions: ConvTimings, LinkOptions: LinkResult,
}
"""The result type that answers each kind of profiling options."""


class ProfileCompute(_Msg, frozen=True, tag="profile_compute"):
    """Measure this device's compute; answered by a ``ProfileResult`` holding ``RESULT_OF[type(options)]``."""

    options: ProfileOptions


class MeasureLink(_Msg, frozen=True, tag="measure_link"):
    """Measure the data link to ``peer``; answered by a ``ProfileResult`` holding a ``LinkResult``."""

    peer: PeerSpec
    options: LinkOptions


class ProfileResult(_Msg, frozen=True, tag="profile_result"):
    result: ProfileOutcome


class Ok(_Msg, frozen=True, tag="ok"):
    detail: str = ""


class ErrorReply(_Msg, frozen=True, tag="error"):
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


class SpatialNet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which CNN (agents.spatial.NETWORKS) and the seed of its generated weights."""

    network: str
    image: int
    width_div: int = 1
    classes: int = 1000
    seed: int = 0


class ComputeStrip(_Msg, frozen=True, tag="compute_strip"):
    """Spatial partitioning: compute output columns [lo, hi) of layers [start, end) from an input
    strip holding columns [x_lo, x_lo + W) (float32, ``shape`` N×C×H×W, raw bytes, never
    pickled); ``head``: then run the FC head on it (the gateway, on the gathered map).
    Answered by ``StripComputed``. A strip must fit one control frame (``MAX_CONTROL_FRAME``)."""

    net: SpatialNet
    start: int
    end: int
    x_lo: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    data: bytes
    head: bool = False


class StripComputed(_Msg, frozen=True, tag="strip_computed"):
    """The strip (or class scores) computed, with when it ran on the agent's clock."""

    shape: tuple[int, ...]
    data: bytes
    t_start: float
    t_end: float


class SpatialSetup(_Msg, frozen=True, tag="spatial_setup"):
    """Spatial partitioning over the data plane (``agents.spatial_run``): this device's part of a
    map-reduce run. Every device of the plan gets it, workers first; the gateway then takes
    ``ClassifyImage`` requests, scatters each tile's strips (with their halos) to the workers' data
    sockets, computes its own, gathers theirs and runs the head; a worker computes the strips it
    receives and sends them back to the gateway. Answered ``Ok`` once the network is built and
    the peers' keys are allowed; ends with ``StopRun`` (or the lease)."""

    run_id: str
    net: SpatialNet
    devices: tuple[PeerSpec, ...]
    """The plan's devices, ``stage`` = their index in each tile's widths."""
    gateway: str
    groups: tuple[tuple[int, int], ...]
    """Tiles: layer ranges [start, end), consecutive, covering every spatial layer."""
    widths: tuple[tuple[int, ...], ...]
    """Per tile, each device's output columns (left to right, summing to the tile's width)."""
    lease_s: float = 0.0
    strip_timeout_s: float = 60.0
    """How long the gateway waits for a worker's strip before the image fails naming it."""


class ClassifyImage(_Msg, frozen=True, tag="classify_image"):
    """To the gateway of a spatial run: one image (float32 1×3×H×W, raw bytes). Answered by
    ``ImageClassified`` (or an ``ErrorReply`` naming the worker that did not answer)."""

    run_id: str
    image: int
    shape: tuple[int, ...]
    data: bytes


class StripTimes(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One strip of one image as it went: ``scattered``/``gathered`` on the gateway's clock,
    ``received``/``start``/``end`` on the computing device's clock (the coordinator maps each
    through its own offset). The head is the tile numbered ``len(groups)`` on the gateway."""

    device: str
    group: int
    scattered: float
    received: float
    start: float
    end: float
    gathered: float
    in_bytes: int = 0
    out_bytes: int = 0


class ImageClassified(_Msg, frozen=True, tag="image_classified"):
    image: int
    scores: tuple[float, ...]
    strips: tuple[StripTimes, ...]


class AttendHeads(_Msg, frozen=True, tag="attend_heads"):
    """Attention offloading: this memory agent holds the KV of key/value heads [kv_start, kv_stop)
    of ``model_dir``'s geometry; append ``key``/``value`` (float32 [B, h, q, D]) of ``layer`` for
    micro-batch ``group`` and attend ``query`` ([B, h·g, q, D]) over the cache, ``mask`` (uint8
    0/1, ``mask_shape`` [B, 1, q, kv], or empty) applied. Raw bytes, never pickled. Answered by
    ``HeadsAttended`` ([B, q, h·g, D]). ``drop``: forget ``group``'s cache of ``drop_layers``
    instead (no tensors; answered by ``Ok``)."""

    model_dir: str
    kv_start: int
    kv_stop: int
    group: int
    layer: int = 0
    q_shape: tuple[int, ...] = ()
    kv_shape: tuple[int, ...] = ()
    query: bytes = b""
    key: bytes = b""
    value: bytes = b""
    mask_shape: tuple[int, ...] = ()
    mask: bytes = b""
    scaling: float = 1.0
    drop: bool = False
    drop_layers: tuple[int, ...] = ()


class HoldHeads(_Msg, frozen=True, tag="hold_heads"):
    """Attention offloading on the data plane: hold the KV of key/value heads [kv_start, kv_stop)
    of ``model_dir``'s geometry and serve ``DataHeader(kind="attend")`` frames from the ``dense``
    agents (answered with ``kind="attended"`` frames to their data sockets) until a ``StopRun``
    naming ``run_id``. Answered by ``Ok`` once serving."""

    run_id: str
    model_dir: str
    kv_start: int
    kv_stop: int
    dense: tuple[PeerSpec, ...]
    lease_s: float = 0.0
    link: LinkShape = LinkShape()
    """Emulation of this agent's outgoing link (the replies)."""
    kv: KvReservation = KvReservation()
    """The KV cache the run will need at most (micro-batches × sequences × context tokens): a
    memory agent whose (emulated) memory budget cannot hold its heads' share refuses the hold."""


class HoldDense(_Msg, frozen=True, tag="hold_dense"):
    """Attention offloading's staggered pipelining: load the whole dense part of ``model_dir`` and
    serve as compute replica ``replica`` of ``staggered`` (never replica 0: that one is the run's
    source stage) the slices ``agents.schedule.staggered_slices`` gives it, for a run whose
    micro-batches, prompts and sampling are these, until a ``StopRun`` naming ``run_id``.
    ``services``: the memory agents and their key/value heads. Answered by ``Ok`` once loaded."""

    run_id: str
    model_dir: str
    replica: int
    staggered: StaggeredSpec
    services: tuple[ServicePeer, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    input_ids: tuple[tuple[int, ...], ...]
    attention_mask: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    sampling: SamplingSpec = SamplingSpec()
    dtype: str = "float32"
    threads: int = 0
    lease_s: float = 0.0
    link: LinkShape = LinkShape()


class HeadsAttended(_Msg, frozen=True, tag="heads_attended"):
    """The attention output of the heads, with when it ran on the agent's clock."""

    shape: tuple[int, ...]
    data: bytes
    t_start: float
    t_end: float


MAX_RNG_STATE = 1 << 14
"""Bytes of a sampling generator's state (torch's CPU mt19937 state is 5056)."""


class EncodeTiles(_Msg, frozen=True, tag="encode_tiles"):
    """EPD encode (agents.phases): run the vision tower and projector over tiles ``tiles`` of
    request ``request`` (float32 N×3×T×T, raw bytes, never pickled). Answered by ``TilesEncoded``."""

    request: int
    tiles: tuple[int, ...]
    shape: tuple[int, ...]
    data: bytes
    send_to: str = ""
    """Push the tokens to this prefill device's data socket (as piece ``piece``) instead of replying
    with them."""
    piece: int = 0


class TilesEncoded(_Msg, frozen=True, tag="tiles_encoded"):
    """The tiles' multimodal tokens (float32 N×S×H), with when they ran on the agent's clock."""

    request: int
    tiles: tuple[int, ...]
    shape: tuple[int, ...]
    data: bytes
    """Empty when the tokens went to ``sent_to`` over the data plane."""
    t_start: float
    t_end: float
    sent_to: str = ""
    t_sent: float = 0.0


class PrefillPrompt(_Msg, frozen=True, tag="prefill_prompt"):
    """EPD prefill: ``input_ids`` with one ``<image>`` per row of ``mm`` (float32 M×H multimodal
    tokens in prompt order); build the KV cache and pick the first token. Answered by
    ``PromptPrefilled``."""

    request: int
    input_ids: tuple[int, ...]
    mm_shape: tuple[int, ...] = ()
    mm: bytes = b""
    """Empty for a text-only prompt, or when the tokens come over the data plane (``mm_pieces``)."""
    sampling: SamplingSpec = SamplingSpec()
    mm_pieces: tuple[int, ...] = ()
    """The pieces (in prompt order) whose tokens encode agents push to this agent's data socket."""
    send_to: str = ""
    """Push the KV cache to this decode device's data socket instead of replying with it."""


class PromptPrefilled(_Msg, frozen=True, tag="prompt_prefilled"):
    """The first token, the KV cache (float32 [layers, 2, kv heads, tokens, head dim]) and the
    sampling generator's state after the first draw (decode goes on from it)."""

    request: int
    token: int
    kv_shape: tuple[int, ...]
    kv: bytes
    """Empty when the cache went to ``sent_to`` over the data plane."""
    rng: bytes
    t_start: float
    t_end: float
    mm_received: float = 0.0
    """When the last multimodal piece arrived over the data plane (agent clock; 0: none did)."""
    sent_to: str = ""


class DecodeTokens(_Msg, frozen=True, tag="decode_tokens"):
    """EPD decode: from ``kv`` and the first token, generate up to ``max_new_tokens`` in all
    (the first included), stopping after an eos. ``copies`` > 1 decodes that many copies as one
    batch (profiling). Answered by ``TokensDecoded``."""

    request: int
    first_token: int
    kv_shape: tuple[int, ...]
    kv: bytes
    max_new_tokens: int
    sampling: SamplingSpec = SamplingSpec()
    rng: bytes = b""
    eos_token_ids: tuple[int, ...] = ()
    copies: int = 1
    kv_from: str = ""
    """The KV cache (``kv_shape``; ``kv`` empty) comes over the data plane from this prefill device."""


class TokensDecoded(_Msg, frozen=True, tag="tokens_decoded"):
    """The tokens after the first, and when each decode step ended on the agent's clock."""

    request: int
    tokens: tuple[int, ...]
    step_ends: tuple[float, ...]
    t_start: float
    t_end: float
    kv_received: float = 0.0
    """When the KV cache arrived over the data plane (agent clock; 0: it came with the request)."""


ControlMessage = Union[
    Ping, Pong, GetStatus, AgentStatus, LoadShard, Unload, StartRun, StopRun, GetLogs, Logs,
    ProfileCompute, MeasureLink, ProfileResult, Ok, ErrorReply, EventBatch, TokensProduced,
    RunFinished, RunError, LogLine, QueryWeights, WeightsHeld, PutWeights, ComputeStrip, StripComputed,
    AttendHeads, HoldHeads, HoldDense, HeadsAttended, EncodeTiles, TilesEncoded, PrefillPrompt, PromptPrefilled, DecodeTokens,
    TokensDecoded, SpatialSetup, ClassifyImage, ImageClassified,
]  # fmt: skip


class _Head(msgspec.Struct):
    v: Any = None
    type: Any = None
    req: Any = None


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
    except Exception as err:  # any bytes: invalid UTF-8 and deep nesting raise other types than msgspec's
        raise ProtocolError("bad_frame", f"not a msgpack map: {_reason(err)}") from None
    req = head.req if type(head.req) is int and 0 <= head.req < 1 << 63 else 0
    if head.v != PROTOCOL_VERSION:
        raise VersionMismatch(head.v, req, f"protocol version {_short(head.v)} received, version {PROTOCOL_VERSION} "
                                           f"supported here: {UPGRADE_HINT}")
    try:
        msg = _control_decoder.decode(frame)
    except Exception as err:
        raise ProtocolError("bad_message", f"{_short(head.type)}: {_reason(err)}", req) from None
    problem = message_problem(msg)
    if problem:
        raise ProtocolError("bad_message", f"{msg.type_name()}: {problem}", req)
    return msg


def _reason(err: BaseException) -> str:
    """One line for a decode failure, whatever raised it."""
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return _short(f"{type(err).__name__}: {err}" if not isinstance(err, msgspec.MsgspecError) else str(err), 200)


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------
# Field ranges: what decodes by type can still be nonsense (NaN, 10**6 threads, a peer
# address that is not tcp://host:port). Checked once, here, for every control frame.
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


def _finite(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def _ints_problem(name: str, values: tuple[int, ...], lo: int, hi: int, most: int, least: int = 1) -> str:
    if not least <= len(values) <= most or any(not lo <= x <= hi for x in values):
        return f"{name} must be {least}..{most} integers in [{lo}, {hi}], got {list(values)[:8]}"
    return ""


_PROFILE_DTYPES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,3})?)$")


def _compute_options_problem(o: ComputeOptions) -> str:
    """What to time, bounded: a request must not pin a device's worker for hours."""
    if not isinstance(o.config.get("model_type"), str):
        return "compute options: config must be a model's config.json naming its model_type"
    return (
        ("" if 1 <= o.prompt_tokens <= MAX_NEW_TOKENS and 0 <= o.context_tokens <= MAX_NEW_TOKENS
         else f"compute options: prompt_tokens must be in [1, {MAX_NEW_TOKENS}], "
              f"context_tokens in [0, {MAX_NEW_TOKENS}]")
        or _ints_problem("compute options: batch_sizes", o.batch_sizes, 1, MAX_ROWS, 16)
        or _ints_problem("compute options: prefill_batch_sizes", o.prefill_batch_sizes, 1, MAX_ROWS, 16)
        or _ints_problem("compute options: units", o.units, 0, MAX_STAGES, MAX_STAGES, least=0)
        or ("" if 1 <= o.repeats <= 1000 and 0 <= o.warmup <= 1000
            else "compute options: repeats must be in [1, 1000] and warmup in [0, 1000]")
        or ("" if o.dtype in _PROFILE_DTYPES
            else f"compute options: dtype must be one of {', '.join(_PROFILE_DTYPES)}")
        or ("" if 0 <= o.threads <= MAX_THREADS else f"compute options: threads must be in [0, {MAX_THREADS}]")
        or ("" if 0 <= o.headroom_bytes < 1 << 50 and 0 <= o.seed < 1 << 63
            else "compute options: headroom_bytes must be in [0, 2**50) and seed in [0, 2**63)")
        or ("" if _DEVICE.match(o.device)
            else f"compute options: device must be cpu or cuda[:N], got {_short(o.device)}")
    )


def _conv_sweep_problem(o: ConvSweepOptions) -> str:
    if (_ints_problem("", o.sizes, 4, 256, 12) or _ints_problem("", o.channels, 1, 512, 6)
            or not 1 <= o.repeats <= 20 or not 0 <= o.threads <= MAX_THREADS):
        return ("conv-sweep options: sizes = 1..12 ints in [4, 256], channels = 1..6 ints in [1, 512], "
                f"repeats in [1, 20], threads in [0, {MAX_THREADS}]; got sizes={list(o.sizes)[:13]}, "
                f"channels={list(o.channels)[:7]}, repeats={o.repeats}, threads={o.threads}")
    return ""


def _link_options_problem(o: LinkOptions) -> str:
    """A NaN or 1e9 timeout, or terabytes to send, would pin both agents' workers."""
    if not (_finite(o.timeout_s, 0.001, MAX_TIMEOUT_S) and _finite(o.latency_gap_s, 0, 10)
            and _finite(o.warmup_fraction, 0, 0.99)):
        return (f"link options: timeout_s must be in (0, {MAX_TIMEOUT_S:.0f}], latency_gap_s in [0, 10] and "
                f"warmup_fraction in [0, 0.99], got {o.timeout_s!r}, {o.latency_gap_s!r}, {o.warmup_fraction!r}")
    if not (1 <= o.nbytes <= 1 << 32 and 1 <= o.chunk_bytes <= 64 << 20 and 0 <= o.latency_probes <= 10_000):
        return ("link options: nbytes must be in [1, 2**32], chunk_bytes in [1, 64 MiB] and latency_probes in "
                f"[0, 10000], got {o.nbytes}, {o.chunk_bytes}, {o.latency_probes}")
    if not 1 <= len(o.probe_id) <= 64:
        return "link options: probe_id must be 1..64 characters"
    return ""


def _all_finite(values, lo: float = 0.0) -> bool:
    return all(math.isfinite(x) and x >= lo for x in values)


def _outcome_problem(r: ProfileOutcome) -> str:
    """A result the coordinator can build a profile from: shapes agree, times finite and >= 0."""
    if isinstance(r, ComputeProfile):
        for u in r.units:
            if not (len(u.decode_s) == len(u.decode_spread) == len(r.decode_batch_sizes)
                    and len(u.prefill_s) == len(u.prefill_spread) == len(r.prefill_token_counts)):
                return f"unit {u.unit}: one time per decode batch size and per prefill token count"
            if not (_all_finite(u.decode_s) and _all_finite(u.prefill_s) and _all_finite(u.decode_spread)
                    and _all_finite(u.prefill_spread) and u.unit >= 0 and u.param_bytes >= 0):
                return f"unit {u.unit}: times, spreads and sizes must be finite and >= 0"
        if not (_all_finite((r.seconds, r.stage_decode_overhead_s, r.stage_prefill_overhead_s))
                and min(r.memory_budget_bytes, r.memory_total_bytes, r.memory_available_bytes, r.cores) >= 0):
            return "compute profile: seconds, overheads, memory and cores must be finite and >= 0"
    elif isinstance(r, ConvTimings):
        if not r.samples or not all(_all_finite(pair) for pair in (*r.samples, *r.fc_samples)):
            return "conv timings: at least one (FLOPs, seconds) pair, every one finite and >= 0"
    elif not (_all_finite((r.bandwidth_mbit_s, r.seconds)) and r.bytes_received >= 0
              and _all_finite(r.one_way_s, lo=-math.inf)):
        return "link result: bandwidth, seconds and bytes must be finite and >= 0, one-way times finite"
    return ""


def _peer_problem(peer: PeerSpec) -> str:
    if not is_data_address(peer.data_address):
        return f"peer {peer.device!r}: data_address must be tcp://host:port, got {_short(peer.data_address)}"
    if len(peer.public_key) != 40:
        return f"peer {peer.device!r}: public_key must be a 40-character Z85 key"
    if not 0 <= peer.stage < MAX_STAGES:
        return f"peer {peer.device!r}: stage must be in [0, {MAX_STAGES})"
    return ""


def _net_problem(net: SpatialNet) -> str:
    if not (32 <= net.image <= 4096 and 1 <= net.width_div <= 4096 and 1 <= net.classes <= 100_000):
        return "net: image must be in [32, 4096], width_div in [1, 4096], classes in [1, 100000]"
    return ""


def _strip_problem(msg: ComputeStrip) -> str:
    if _net_problem(msg.net):
        return _net_problem(msg.net)
    if not (0 <= msg.start <= msg.end <= 256 and (msg.start < msg.end or msg.head)):
        return f"layers must be a range [start, end) within [0, 256] (empty only with head), got [{msg.start}, {msg.end})"
    if not (0 <= msg.x_lo and 0 <= msg.lo < msg.hi <= 1 << 16):
        return f"columns must satisfy 0 <= x_lo and 0 <= lo < hi, got x_lo={msg.x_lo} [{msg.lo}, {msg.hi})"
    if len(msg.shape) != 4 or any(not 1 <= d <= 1 << 16 for d in msg.shape):
        return f"shape must be 4 dims N×C×H×W in [1, 65536], got {list(msg.shape)[:8]}"
    n, c, h, w = msg.shape
    if n * c * h * w * 4 != len(msg.data):
        return f"data holds {len(msg.data)} bytes, shape {list(msg.shape)} needs {n * c * h * w * 4} (float32)"
    return ""


def _spatial_setup_problem(msg: SpatialSetup) -> str:
    """Ranges only; whether the tiles fit the network is the agent's check (it has the geometry)."""
    if _net_problem(msg.net):
        return _net_problem(msg.net)
    if not 1 <= len(msg.devices) <= MAX_STAGES:
        return f"devices must list 1..{MAX_STAGES} devices"
    if sorted(p.stage for p in msg.devices) != list(range(len(msg.devices))):
        return "devices must be stages 0..n-1 once each"
    if len({p.device for p in msg.devices}) != len(msg.devices):
        return "devices must be named once each"
    for p in msg.devices:
        problem = _peer_problem(p)
        if problem:
            return problem
    if msg.gateway not in {p.device for p in msg.devices}:
        return f"gateway {_short(msg.gateway)} is not one of the devices"
    if not 1 <= len(msg.groups) <= 256 or len(msg.widths) != len(msg.groups):
        return "groups must list 1..256 tiles, with one widths row each"
    at = 0
    for start, end in msg.groups:
        if start != at or not start < end <= 256:
            return f"groups must be consecutive non-empty layer ranges from 0, got [{start}, {end}) after {at}"
        at = end
    if any(len(row) != len(msg.devices) or any(not 0 <= w <= 1 << 16 for w in row) for row in msg.widths):
        return "every widths row must give each device 0..65536 columns"
    if not (_finite(msg.lease_s, 0, MAX_TIMEOUT_S) and _finite(msg.strip_timeout_s, 0.001, MAX_TIMEOUT_S)):
        return f"lease_s must be in [0, {MAX_TIMEOUT_S:.0f}] and strip_timeout_s in (0, {MAX_TIMEOUT_S:.0f}]"
    return ""


def _image_problem(msg: ClassifyImage) -> str:
    if not 0 <= msg.image < 1 << 31:
        return f"image must be an index >= 0, got {msg.image}"
    if len(msg.shape) != 4 or msg.shape[0] != 1 or any(not 1 <= d <= 1 << 16 for d in msg.shape):
        return f"shape must be 1×C×H×W (dims in [1, 65536]), got {list(msg.shape)[:8]}"
    if math.prod(msg.shape) * 4 != len(msg.data):
        return f"data holds {len(msg.data)} bytes, shape {list(msg.shape)} needs {math.prod(msg.shape) * 4} (float32)"
    return ""


def _attend_problem(msg: AttendHeads) -> str:
    if not (0 <= msg.kv_start < msg.kv_stop <= 4096 and 0 <= msg.group < 1 << 20 and 0 <= msg.layer < 4096):
        return "kv heads must be a range [kv_start, kv_stop) within [0, 4096], group and layer >= 0"
    if not all(0 <= x < 4096 for x in msg.drop_layers) or len(msg.drop_layers) > 4096:
        return "drop_layers must be layer indices in [0, 4096)"
    if msg.drop:
        return ""
    if not (math.isfinite(msg.scaling) and msg.scaling > 0):
        return "scaling must be a finite number > 0"
    for name, shape in (("q_shape", msg.q_shape), ("kv_shape", msg.kv_shape)):
        if len(shape) != 4 or any(not 1 <= d <= 1 << 16 for d in shape):
            return f"{name} must be 4 dims B×H×T×D in [1, 65536], got {list(shape)[:8]}"
    b, h, t, d = msg.kv_shape
    if msg.q_shape[0] != b or msg.q_shape[2] != t or msg.q_shape[3] != d or h != msg.kv_stop - msg.kv_start \
            or msg.q_shape[1] % h:
        return f"q_shape {list(msg.q_shape)} and kv_shape {list(msg.kv_shape)} do not fit heads [{msg.kv_start}, {msg.kv_stop})"
    for name, shape, data in (("query", msg.q_shape, msg.query), ("key", msg.kv_shape, msg.key),
                              ("value", msg.kv_shape, msg.value)):
        if math.prod(shape) * 4 != len(data):
            return f"{name} holds {len(data)} bytes, shape {list(shape)} needs {math.prod(shape) * 4} (float32)"
    if msg.mask_shape:
        if len(msg.mask_shape) != 4 or any(not 1 <= x <= 1 << 20 for x in msg.mask_shape) \
                or msg.mask_shape[0] != b or msg.mask_shape[2] != t:
            return f"mask_shape must be [B, 1, q, kv] for this query, got {list(msg.mask_shape)[:8]}"
        if math.prod(msg.mask_shape) != len(msg.mask):
            return f"mask holds {len(msg.mask)} bytes, shape {list(msg.mask_shape)} needs {math.prod(msg.mask_shape)}"
    elif msg.mask:
        return "mask bytes without a mask_shape"
    return ""


def _float_tensor_problem(name: str, shape: tuple[int, ...], data: bytes, dims: int) -> str:
    if len(shape) != dims or any(not 1 <= d <= 1 << 20 for d in shape):
        return f"{name} shape must be {dims} dims in [1, 1048576], got {list(shape)[:8]}"
    if math.prod(shape) * 4 != len(data):
        return f"{name} holds {len(data)} bytes, shape {list(shape)} needs {math.prod(shape) * 4} (float32)"
    return ""


def _sampling_problem(s: SamplingSpec) -> str:
    if not _finite(s.temperature, 0, 100) or not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        return "sampling.temperature must be in [0, 100] and sampling.top_p in (0, 1]"
    if s.top_k < 0 or not 0 <= s.seed < 1 << 63:
        return "sampling.top_k must be >= 0 and sampling.seed in [0, 2**63)"
    if s.uses_history:
        return "phase requests sample without a repetition penalty or n-gram ban (not supported by EPD)"
    return ""


def _phase_problem(msg) -> str:
    """EPD's phase requests and replies: ids in range, every tensor's bytes match its shape."""
    if not 0 <= msg.request < 1 << 63:
        return "request must be in [0, 2**63)"
    if isinstance(msg, (EncodeTiles, TilesEncoded)):
        if not msg.tiles or len(msg.tiles) != (msg.shape[0] if msg.shape else -1) or not all(
                0 <= t < 1 << 16 for t in msg.tiles):
            return f"tiles must name one tile index in [0, 65536) per row of the tensor, got {list(msg.tiles)[:8]}"
        sent = isinstance(msg, TilesEncoded) and msg.sent_to
        if sent:
            return "" if not msg.data and len(msg.shape) == 3 else "tokens sent over the data plane carry no bytes here"
        if isinstance(msg, EncodeTiles) and not 0 <= msg.piece < 1 << 16:
            return "piece must be in [0, 65536)"
        return _float_tensor_problem("tiles" if isinstance(msg, EncodeTiles) else "tokens", msg.shape, msg.data,
                                     4 if isinstance(msg, EncodeTiles) else 3)
    if isinstance(msg, PrefillPrompt):
        if not 1 <= len(msg.input_ids) <= 1 << 16 or not all(0 <= i < 1 << 31 for i in msg.input_ids):
            return "input_ids must be 1..65536 token ids in [0, 2**31)"
        if msg.mm_pieces:
            if msg.mm or len(msg.mm_shape) != 2 or len(msg.mm_pieces) > 1 << 16 or \
                    len(set(msg.mm_pieces)) != len(msg.mm_pieces) or not all(0 <= p < 1 << 16 for p in msg.mm_pieces):
                return "mm_pieces: distinct piece ids in [0, 65536), an M×H mm_shape and no mm bytes"
            mm = ""
        else:
            mm = _float_tensor_problem("mm", msg.mm_shape, msg.mm, 2) if msg.mm_shape or msg.mm else ""
        return mm or _sampling_problem(msg.sampling)
    if isinstance(msg, (PromptPrefilled, DecodeTokens)):
        token = msg.token if isinstance(msg, PromptPrefilled) else msg.first_token
        if not 0 <= token < 1 << 31 or len(msg.rng) > MAX_RNG_STATE:
            return f"token must be in [0, 2**31) and rng at most {MAX_RNG_STATE} bytes"
        moved = msg.sent_to if isinstance(msg, PromptPrefilled) else msg.kv_from
        if moved:
            ok = not msg.kv and len(msg.kv_shape) == 5 and all(1 <= d <= 1 << 20 for d in msg.kv_shape)
            problem = "" if ok else "a KV cache moved over the data plane has a 5-dim kv_shape and no kv bytes"
        else:
            problem = _float_tensor_problem("kv", msg.kv_shape, msg.kv, 5)
        if problem or isinstance(msg, PromptPrefilled):
            return problem
        if not 1 <= msg.max_new_tokens <= MAX_NEW_TOKENS or not 1 <= msg.copies <= MAX_ROWS:
            return f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}] and copies in [1, {MAX_ROWS}]"
        if len(msg.eos_token_ids) > 64:
            return "at most 64 eos_token_ids"
        return _sampling_problem(msg.sampling)
    if isinstance(msg, TokensDecoded):
        if len(msg.tokens) != len(msg.step_ends) or len(msg.tokens) > MAX_NEW_TOKENS:
            return "one step end per token, at most max_new_tokens"
    return ""


PHASE_MESSAGES = (EncodeTiles, TilesEncoded, PrefillPrompt, PromptPrefilled, DecodeTokens, TokensDecoded)
PHASE_REQUESTS = (EncodeTiles, PrefillPrompt, DecodeTokens)


def _hold_dense_problem(msg: HoldDense) -> str:
    spec = msg.staggered
    if spec.schedule not in ("fixed", "rotational"):
        return f"staggered schedule must be fixed or rotational, got {spec.schedule!r}"
    if not 1 <= msg.replica < len(spec.replicas) <= 64:
        return "a held replica is one of 2 to 64 replicas, never replica 0 (the source)"
    if not msg.services or len(msg.services) > 64:
        return "a replica calls 1 to 64 memory agents"
    if not 0 <= msg.threads <= MAX_THREADS or not (math.isfinite(msg.lease_s) and msg.lease_s >= 0):
        return f"threads must be in [0, {MAX_THREADS}] and lease_s a finite number >= 0"
    if not 1 <= msg.max_new_tokens <= 1 << 16 or len(msg.input_ids) != len(msg.attention_mask):
        return "max_new_tokens must be in [1, 65536] and there must be one mask row per prompt row"
    n = len(msg.input_ids)
    if not msg.micro_batches or any(not g or any(not 0 <= i < n for i in g) for g in msg.micro_batches):
        return "micro_batches must be non-empty groups of prompt rows"
    return _sampling_problem(msg.sampling)


def message_problem(msg: ControlMessage) -> str:
    """What is out of range in a decoded message ("" when nothing): the one semantic check."""
    if isinstance(msg, PHASE_MESSAGES):
        return _phase_problem(msg)
    if isinstance(msg, ComputeStrip):
        return _strip_problem(msg)
    if isinstance(msg, AttendHeads):
        return _attend_problem(msg)
    if isinstance(msg, HoldHeads):
        if not 0 <= msg.kv_start < msg.kv_stop <= 4096:
            return "kv heads must be a range [kv_start, kv_stop) within [0, 4096]"
        if not msg.dense or len(msg.dense) > 64:
            return "a memory agent serves 1 to 64 dense agents"
        if not (math.isfinite(msg.lease_s) and msg.lease_s >= 0):
            return "lease_s must be a finite number >= 0"
    if isinstance(msg, HoldDense):
        return _hold_dense_problem(msg)
    if isinstance(msg, SpatialSetup):
        return _spatial_setup_problem(msg)
    if isinstance(msg, ClassifyImage):
        return _image_problem(msg)
    if isinstance(msg, ImageClassified):
        if len(msg.scores) > 100_000 or len(msg.strips) > 1 << 16 or not _all_finite(msg.scores, lo=-math.inf):
            return "scores must be at most 100000 finite numbers, strips at most 65536"
    if isinstance(msg, LoadShard):
        if not 0 <= msg.threads <= MAX_THREADS:
            return f"threads must be in [0, {MAX_THREADS}], got {msg.threads}"
        if not 0 <= msg.start < msg.end:
            return f"units must be a non-empty range [start, end), got [{msg.start}, {msg.end})"
        if not msg.peers or len(msg.peers) > MAX_STAGES:
            return f"peers must list 1..{MAX_STAGES} stages"
        stages = sorted(p.stage for p in msg.peers)
        if stages != list(range(len(stages))):
            return f"peers must be stages 0..{len(stages) - 1} once each, got {stages}"
        if not 0 <= msg.stage < len(msg.peers):
            return f"stage must be in [0, {len(msg.peers)}), got {msg.stage}"
        for p in msg.peers:
            problem = _peer_problem(p)
            if problem:
                return problem
        if msg.dtype not in DTYPE_SIZES:
            return f"dtype must be one of {', '.join(DTYPE_SIZES)}, got {_short(msg.dtype)}"
        link = msg.link
        if not (_finite(link.bandwidth_mbit_s, 0, 1e6) and _finite(link.latency_ms, 0, 60_000)):
            return "link bandwidth must be in [0, 1e6] Mbit/s and latency in [0, 60000] ms"
    elif isinstance(msg, StartRun):
        s = msg.sampling
        if not _finite(s.temperature, 0, 100):
            return f"sampling.temperature must be a finite number in [0, 100], got {s.temperature!r}"
        if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
            return f"sampling.top_p must be in (0, 1], got {s.top_p!r}"
        if s.top_k < 0 or not 0 <= s.seed < 1 << 63:
            return "sampling.top_k must be >= 0 and sampling.seed in [0, 2**63)"
        if not _finite(s.repetition_penalty, 0, 100) or s.repetition_penalty == 0:
            return f"sampling.repetition_penalty must be a finite number in (0, 100], got {s.repetition_penalty!r}"
        if not 0 <= s.no_repeat_ngram_size <= 64:
            return f"sampling.no_repeat_ngram_size must be in [0, 64], got {s.no_repeat_ngram_size}"
        if not 0 <= msg.max_new_tokens <= MAX_NEW_TOKENS:
            return f"max_new_tokens must be in [0, {MAX_NEW_TOKENS}], got {msg.max_new_tokens}"
        if not math.isfinite(msg.lease_s) or not 0 <= msg.lease_s <= MAX_TIMEOUT_S:
            return f"lease_s must be in [0, {MAX_TIMEOUT_S:.0f}], got {msg.lease_s!r}"
        rows = len(msg.input_ids)
        if rows > MAX_ROWS or len(msg.attention_mask) != rows:
            return f"input_ids and attention_mask must have the same rows (at most {MAX_ROWS})"
        if any(len(a) != len(b) for a, b in zip(msg.input_ids, msg.attention_mask)):
            return "each attention_mask row must be as long as its input_ids row"
        if len({len(r) for r in msg.input_ids}) > 1:
            return "input_ids rows must be padded to one length"
        seen = sorted(i for mb in msg.micro_batches for i in mb)
        if rows and seen != list(range(rows)):
            return f"micro_batches must cover sequences 0..{rows - 1} once each"
        if any(not mb for mb in msg.micro_batches):
            return "micro_batches must not be empty"
        for name, per_mb in (("first_steps", msg.first_steps), ("micro_batch_keys", msg.micro_batch_keys)):
            if len(per_mb) > MAX_ROWS or any(not 0 <= v <= MAX_NEW_TOKENS for v in per_mb):
                return f"{name} must hold at most {MAX_ROWS} values in [0, {MAX_NEW_TOKENS}]"
        if msg.generated and (len(msg.generated) != rows
                              or any(len(g) > MAX_NEW_TOKENS or any(not 0 <= t < 1 << 31 for t in g)
                                     for g in msg.generated)):
            return f"generated must hold one row of token ids per sequence ({rows}), each at most {MAX_NEW_TOKENS}"
    elif isinstance(msg, MeasureLink):
        return _peer_problem(msg.peer) or _link_options_problem(msg.options)
    elif isinstance(msg, ProfileCompute):
        o = msg.options
        return _compute_options_problem(o) if isinstance(o, ComputeOptions) else _conv_sweep_problem(o)
    elif isinstance(msg, ProfileResult):
        return _outcome_problem(msg.result)
    elif isinstance(msg, GetLogs):
        if not 0 <= msg.lines <= 100_000:
            return f"lines must be in [0, 100000], got {msg.lines}"
    return ""


# --------------------------------------------------------------------------------------
# Data frames (stage -> stage activations, last stage -> source token ids)
#
# A data message is multipart: [header, tensor bytes, tensor bytes, ...]. The header
# names each tensor's dtype and shape; the receiver checks the byte counts match before
# viewing the bytes as a tensor (zero-copy, never pickled).
# --------------------------------------------------------------------------------------

DataKind = Literal["hidden", "tokens", "probe", "strip", "attend", "attended", "mm", "kv", "residual", "start"]
"""``strip``: a spatial run's strip, gateway -> worker (its input with halo) and back (its output).
``mm``: EPD multimodal tokens, encode -> prefill (step = request, micro_batch = piece); ``kv``: an
EPD KV cache, prefill -> decode (layers·2 × kv heads × tokens × head dim). ``residual``: attention
offloading's staggered pipelining, a batch's residual stream handed to the replica of its next slice
(tensors: hidden, the sampled token ids so far [B, steps]); ``start``: the source tells the other
replicas a staggered run began (no tensors)."""

MAX_DATA_TENSORS = 4
MAX_DIM = 1 << 31
"""Largest size of one tensor dimension; with the byte limit it keeps shape arithmetic (and
torch's stride computation) from overflowing."""
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


MaskMode = Literal["none", "full", "same", "next"]
"""How an ``attend`` frame's mask reaches the memory side: none; ``full`` (sent, a uint8 tensor);
``same`` as the last one of this micro-batch (the next layer of a step); ``next``: the last one's
last row with one more visible column (the next decode step). Only ``full`` costs bytes."""


class AttendSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an ``attend``/``attended`` data frame is about (tensors: q, k, v[, mask] / output)."""

    layer: int
    kv_start: int
    kv_stop: int
    scaling: float = 1.0
    mask: MaskMode = "none"
    t_start: float = 0.0
    t_end: float = 0.0
    """``attended``: when the attention ran, on the memory agent's clock."""
    reply_to: str = ""
    """``attend``: the compute replica the output goes to (staggered pipelining: the one that runs
    the batch's next slice); empty: the sender. ``residual`` frames name the layer whose attention
    the receiving replica resumes after."""


class DataHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    run_id: str
    kind: DataKind
    phase: Phase
    step: int
    micro_batch: int
    sender: str
    tensors: tuple[TensorSpec, ...]
    """hidden: (activation, attention_mask on prefill); tokens: (ids,); strip: (columns,)."""
    t_sent: float = 0.0
    times: tuple[float, ...] = ()
    """Sender-clock times the receiver relays: a spatial strip's result carries (received,
    compute start, compute end); step = image, micro_batch = tile."""
    attend: AttendSpec | None = None
    """``attend``/``attended`` frames (attention offloading): layer, heads, scaling, mask mode."""


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
    except Exception as err:  # any bytes (see decode_control)
        raise ProtocolError("bad_frame", f"data header is not a msgpack map: {_reason(err)}") from None
    if head.v != PROTOCOL_VERSION:
        raise VersionMismatch(head.v, 0, f"data protocol version {_short(head.v)} received from a peer, version "
                                         f"{PROTOCOL_VERSION} supported here: {UPGRADE_HINT}")
    try:
        header = _data_decoder.decode(raw)
    except Exception as err:
        raise ProtocolError("bad_message", f"data header: {_reason(err)}") from None
    # link probes number their latency probes with negative steps (agents.profiler)
    if (header.step < 0 and header.kind != "probe") or header.micro_batch < 0 or header.micro_batch >= MAX_ROWS:
        raise ProtocolError("bad_message", f"step {header.step} / micro_batch {header.micro_batch} out of range")
    if len(header.times) > 8:
        raise ProtocolError("bad_message", f"{len(header.times)} relayed times, at most 8")
    if (header.kind in ("attend", "attended", "residual")) != (header.attend is not None):
        raise ProtocolError("bad_message", "attend/attended/residual frames (and only they) carry an attend spec")
    if header.attend is not None:
        a = header.attend
        if not (0 <= a.layer < 4096 and 0 <= a.kv_start < a.kv_stop <= 4096 and math.isfinite(a.scaling)
                and a.scaling > 0):
            raise ProtocolError("bad_message", "attend spec: layer in [0, 4096), heads [kv_start, kv_stop) in "
                                               "[0, 4096], scaling a finite number > 0")
    if len(header.tensors) > MAX_DATA_TENSORS or len(header.tensors) != len(frames) - 1:
        raise ProtocolError(
            "bad_message", f"header names {len(header.tensors)} tensors, message has {len(frames) - 1}"
        )
    bufs = []
    total = 0
    for spec, frame in zip(header.tensors, frames[1:]):
        if (
            spec.dtype not in DTYPE_SIZES
            or not 1 <= len(spec.shape) <= 4
            or any(not 0 <= d <= MAX_DIM for d in spec.shape)
        ):
            raise ProtocolError("bad_message", f"bad tensor spec {_short(spec, 120)}")
        if spec.nbytes() > max_bytes:
            raise ProtocolError("too_large", f"tensor {_short(spec, 120)} exceeds {max_bytes} bytes")
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if buf.nbytes != spec.nbytes():
            raise ProtocolError("bad_message", f"tensor {spec} needs {spec.nbytes()} bytes, got {buf.nbytes}")
        total += buf.nbytes
        bufs.append(buf)
    if total > max_bytes:
        raise ProtocolError("too_large", f"data message of {total} bytes exceeds {max_bytes}")
    return header, bufs
