"""Data frames: the multipart messages of the data plane (stage activations, sampled token ids,
link probes, and the kinds registered techniques send), checked before any byte is viewed."""

from __future__ import annotations

from typing import NoReturn

import msgspec

from agents import registry
from agents.envelope import (
    MAX_CONTROL_FRAME,
    MAX_ROWS,
    NO_OPTIONS,
    PROTOCOL_VERSION,
    UPGRADE_HINT,
    Phase,
    ProtocolError,
    VersionMismatch,
    options_of,
    reason,
    short,
)


class _Head(msgspec.Struct):
    v: object = None


_head_decoder = msgspec.msgpack.Decoder(_Head)
_encoder = msgspec.msgpack.Encoder()

# --------------------------------------------------------------------------------------
# Data frames (stage -> stage activations, last stage -> source token ids, and the kinds
# registered techniques send)
#
# A data message is multipart: [header, tensor bytes, tensor bytes, ...]. The header
# names each tensor's dtype and shape; the receiver checks the byte counts match before
# viewing the bytes as a tensor (zero-copy, never pickled).
# --------------------------------------------------------------------------------------

DataKind = str
"""``hidden``: a stage's activations to the next; ``tokens``: sampled ids, last stage -> source;
``probe``: a link measurement's (``registry.BASE_DATA_KINDS``); any other kind is a registered
technique's (``registry.DataKind``)."""

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
    options: msgspec.Raw = NO_OPTIONS
    """The kind's own ``Options`` (``registry.DataKind.options``), e.g. what a technique's frame is
    about or times it relays; nil for the base kinds."""


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
    try:  # one decode on the stage loop's path; a header that does not decode is looked at again below
        header = _data_decoder.decode(raw)
    except Exception as err:
        _refuse_undecoded(raw, err)
    if header.v != PROTOCOL_VERSION:
        raise _version_mismatch(header.v)
    # link probes number their latency probes with negative steps (agents.profiler)
    if (header.step < 0 and header.kind != "probe") or header.micro_batch < 0 or header.micro_batch >= MAX_ROWS:
        raise ProtocolError("bad_message", f"step {header.step} / micro_batch {header.micro_batch} out of range")
    _check_data_options(header)
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
            raise ProtocolError("bad_message", f"bad tensor spec {short(spec, 120)}")
        if spec.nbytes() > max_bytes:
            raise ProtocolError("too_large", f"tensor {short(spec, 120)} exceeds {max_bytes} bytes")
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if buf.nbytes != spec.nbytes():
            raise ProtocolError("bad_message", f"tensor {spec} needs {spec.nbytes()} bytes, got {buf.nbytes}")
        total += buf.nbytes
        bufs.append(buf)
    if total > max_bytes:
        raise ProtocolError("too_large", f"data message of {total} bytes exceeds {max_bytes}")
    return header, bufs


def _refuse_undecoded(raw, err: Exception) -> NoReturn:
    """Why a header that does not decode as a ``DataHeader`` is refused: not a msgpack map (``bad_frame``),
    another protocol version's (``VersionMismatch``: its fields may differ), else a bad field."""
    try:
        head = _head_decoder.decode(raw)
    except Exception as head_err:  # any bytes (see decode_control)
        raise ProtocolError("bad_frame", f"data header is not a msgpack map: {reason(head_err)}") from None
    if head.v != PROTOCOL_VERSION:
        raise _version_mismatch(head.v)
    raise ProtocolError("bad_message", f"data header: {reason(err)}") from None


def _version_mismatch(received: object) -> VersionMismatch:
    return VersionMismatch(received, 0, f"data protocol version {short(received)} received from a peer, version "
                                        f"{PROTOCOL_VERSION} supported here: {UPGRADE_HINT}")


def _check_data_options(header: DataHeader) -> None:
    """The frame's kind is a base or a registered one, and it carries exactly the options its kind
    registered (decoded and range-checked), or none."""
    empty = bytes(header.options) == b"\xc0"
    if header.kind in registry.BASE_DATA_KINDS:
        if not empty:
            raise ProtocolError("bad_message", f"{header.kind} frames carry no options")
        return
    kind = registry.data_kind(header.kind)
    if kind is None:
        raise ProtocolError("bad_message", f"data kind {short(header.kind)} is not one this agent runs")
    if empty:
        if kind.options is not None and kind.required:
            raise ProtocolError("bad_message", f"{kind.name} frames carry {kind.options.__name__} options")
        return
    options = options_of(header.options)
    if kind.options is None or type(options) is not kind.options:
        raise ProtocolError("bad_message", f"{kind.name} frames carry "
                                           f"{kind.options.__name__ if kind.options else 'no'} options")
