"""Attention offloading's wire: its control messages, the options it puts on shared messages (a
dense stage's memory agents, a staggered run's replicas) and its data frames' options, registered
with ``agents.registry`` by this room (decoded by the shared total decoder)."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from agents.envelope import (
    MAX_THREADS,
    KvReservation,
    LinkShape,
    Message,
    Options,
    PeerSpec,
    SamplingSpec,
    sampling_without_history_problem,
)
DENSE_KIND = "attention-offload-dense"
MEMORY_KIND = "attention-offload-memory"
"""Stage kinds (``LoadShard.kind``) of the two sides."""


class ServicePeer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An agent a stage calls while it computes, and the part [start, stop) it serves."""

    device: str
    data_address: str
    public_key: str
    start: int
    stop: int


class DenseStage(Options, frozen=True, tag="attention-offload-dense"):
    """``LoadShard.options`` of a dense stage: the memory agents it calls over the data plane while
    it computes, each holding the KV of key/value heads [start, stop)."""

    services: tuple[ServicePeer, ...] = ()

    def data_keys(self) -> tuple[str, ...]:
        return tuple(s.public_key for s in self.services)


class StaggeredSpec(Options, frozen=True, tag="attention-offload-staggered"):
    """Attention offloading with several compute replicas (``schedule.staggered_slices``):
    ``schedule`` (fixed | rotational) and every replica's data plane, replica 0 first (the source).
    As ``StartRun.options`` (source only): the run's micro-batches go over the replicas by that
    schedule (this room's run driver) instead of the plan's stages."""

    schedule: str
    replicas: tuple[PeerSpec, ...]


MaskMode = Literal["none", "full", "same", "next"]
"""How an ``attend`` frame's mask reaches the memory side: none; ``full`` (sent, a uint8 tensor);
``same`` as the last one of this micro-batch (the next layer of a step); ``next``: the last one's
last row with one more visible column (the next decode step). Only ``full`` costs bytes."""


class AttendSpec(Options, frozen=True, tag="attend"):
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


    def problem(self) -> str:
        if not (0 <= self.layer < 4096 and 0 <= self.kv_start < self.kv_stop <= 4096 and math.isfinite(self.scaling)
                and self.scaling > 0):
            return ("attend spec: layer in [0, 4096), heads [kv_start, kv_stop) in [0, 4096], scaling a finite "
                    "number > 0")
        return ""


DATA_KINDS = ("attend", "attended", "residual", "start")
"""``attend``: q, k, v[, mask] to a memory agent; ``attended``: its output back; ``residual``:
staggered pipelining, a batch's residual stream handed to the replica of its next slice
(tensors: hidden, the sampled token ids so far [B, steps]); ``start``: the source tells the other
replicas a staggered run began (no tensors). Every one but ``start`` carries an ``AttendSpec``."""


class AttendHeads(Message, frozen=True, tag="attend_heads"):
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

    def problem(self) -> str:
        return _attend_problem(self)


class HoldHeads(Message, frozen=True, tag="hold_heads"):
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

    def problem(self) -> str:
        if not 0 <= self.kv_start < self.kv_stop <= 4096:
            return "kv heads must be a range [kv_start, kv_stop) within [0, 4096]"
        if not self.dense or len(self.dense) > 64:
            return "a memory agent serves 1 to 64 dense agents"
        if not (math.isfinite(self.lease_s) and self.lease_s >= 0):
            return "lease_s must be a finite number >= 0"
        return ""


class HoldDense(Message, frozen=True, tag="hold_dense"):
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

    def problem(self) -> str:
        return _hold_dense_problem(self)


class HeadsAttended(Message, frozen=True, tag="heads_attended"):
    """The attention output of the heads, with when it ran on the agent's clock."""

    shape: tuple[int, ...]
    data: bytes
    t_start: float
    t_end: float


_NO_HISTORY = "phase requests sample without a repetition penalty or n-gram ban (not supported by EPD)"
"""The refusal a replica's sampling with history got before the wire was split in rooms (kept as it was)."""


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
    return sampling_without_history_problem(msg.sampling, _NO_HISTORY)

