"""A frame mutator for the fuzz tests: valid frames with one field wrong, truncated,
oversized, deeply nested, wrong types, wrong version, flipped bytes, random bytes."""

from __future__ import annotations

import random

import msgspec

from agents.protocol import (
    MAX_CONTROL_FRAME,
    PROTOCOL_VERSION,
    ComputeOptions,
    ConvSweepOptions,
    DataHeader,
    GetLogs,
    GetStatus,
    LinkOptions,
    LoadShard,
    MeasureLink,
    PeerSpec,
    Ping,
    ProfileCompute,
    SamplingSpec,
    StartRun,
    StopRun,
    TensorSpec,
    Unload,
    encode_control,
    encode_data_header,
)

KEY = "k" * 40
_PEER = PeerSpec(device="nowhere", stage=0, data_address="tcp://127.0.0.1:9", public_key=KEY)

WRONG_VALUES = (
    float("nan"), float("inf"), -1, -(2**63), 2**64 - 1, 10**6, "", "x" * 5000, "\udcff".encode("utf-8", "surrogatepass"),
    [], {}, None, True, [[[[[]]]]], {"nested": {"deeper": [1, 2, {"x": None}]}}, b"\x00" * 64,
)  # fmt: skip


def control_seeds() -> list[bytes]:
    """Valid control frames whose mutations do no lasting harm (a load of a missing checkpoint
    fails fast; a stray run is ended by the next coordinator's load)."""
    return [
        encode_control(Ping(t0=1.0)),
        encode_control(GetStatus(req=3)),
        encode_control(GetLogs(req=4, lines=3)),
        encode_control(StopRun(run_id="not-this-run")),
        encode_control(LoadShard(req=5, model_dir="/nonexistent/model", stage=0, start=0, end=2, peers=(_PEER,))),
        encode_control(StartRun(req=6, run_id="fuzz", mode="sequential", max_new_tokens=1,
                                sampling=SamplingSpec(temperature=-1.0))),
        encode_control(Unload(req=9)) + b"\x00",  # trailing byte: never a valid unload
    ]


def control_refusals() -> list[bytes]:
    """Profiling requests with one number out of range, sent as they are (mutating them could
    make a valid one, which would rightly keep the worker busy for minutes)."""
    return [
        encode_control(ProfileCompute(req=7, options=ComputeOptions(config={"model_type": "llama"}, repeats=10**9))),
        encode_control(ProfileCompute(req=7, options=ComputeOptions(config={"model_type": "llama"},
                                                                    batch_sizes=(1 << 20,)))),
        encode_control(ProfileCompute(req=7, options=ConvSweepOptions(sizes=(100_000,)))),
        encode_control(MeasureLink(req=8, peer=_PEER, options=LinkOptions(role="send", timeout_s=1e9))),
        encode_control(MeasureLink(req=8, peer=_PEER, options=LinkOptions(role="receive", timeout_s=float("nan")))),
        encode_control(MeasureLink(req=8, peer=PeerSpec(device="x", stage=0, data_address="tcp://h:0",
                                                        public_key=KEY), options=LinkOptions(role="send"))),
    ]


def data_seeds(run_id: str, hidden: int) -> list[list[bytes]]:
    """Data messages a stage must drop: hidden states of the wrong width, token ids for a step
    that never comes, hidden states at the source, an unknown micro-batch."""

    def msg(kind, phase, step, mb, shapes, dtype="float32"):
        specs = tuple(TensorSpec(dtype, s) for s in shapes)
        head = DataHeader(run_id=run_id, kind=kind, phase=phase, step=step, micro_batch=mb, sender="fuzz",
                          tensors=specs)
        return [encode_data_header(head), *(b"\x01" * s.nbytes() for s in specs)]

    return [
        msg("hidden", "decode", 1, 0, [(1, 1, hidden - 1)]),
        msg("hidden", "prefill", 0, 7, [(1, 3, hidden + 1), (1, 3)], "float32"),
        msg("hidden", "decode", 2, 0, [(1, 1, hidden)], "int64"),
        msg("tokens", "decode", 10**6, 0, [(1,)], "int64"),
        msg("tokens", "decode", 1, 999, [(1,)], "int64"),
        msg("hidden", "decode", 1, 0, [(2, 1, hidden)]),
    ]


class Mutator:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def bytes_(self, frame: bytes) -> bytes:
        r = self.rng
        choice = r.randrange(9)
        if choice == 0:  # truncated
            return frame[: r.randrange(len(frame))]
        if choice == 1:  # flipped bytes
            b = bytearray(frame)
            for _ in range(r.randint(1, 4)):
                i = r.randrange(len(b))
                b[i] = r.randrange(256)
            return bytes(b)
        if choice == 2:  # random bytes
            return r.randbytes(r.randint(0, 64))
        if choice == 3:  # deep nesting
            return b"\x81\xa1v" + b"\x91" * r.randint(1000, 300_000) + b"\x01"
        if choice == 4:  # oversized
            return frame + b"\x00" * (MAX_CONTROL_FRAME + r.randint(1, 1000))
        if choice == 5:  # inserted garbage
            i = r.randrange(len(frame) + 1)
            return frame[:i] + r.randbytes(r.randint(1, 8)) + frame[i:]
        return self.field(frame)

    def field(self, frame: bytes) -> bytes:
        """One field wrong: a wrong type or value, a wrong version, an unknown field."""
        r = self.rng
        try:
            obj = msgspec.msgpack.decode(frame)
        except msgspec.DecodeError:
            return r.randbytes(16)
        if not isinstance(obj, dict) or not obj:
            return frame[::-1]
        key = r.choice(sorted(obj))
        what = r.randrange(4)
        if what == 0:
            obj["v"] = r.choice([0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, -1, str(PROTOCOL_VERSION), None,
                                 1.5])
        elif what == 1:
            obj[f"unknown_{r.randrange(99)}"] = 1
        elif what == 2:
            obj.pop(key)
        else:
            value = r.choice(WRONG_VALUES)
            obj[key] = value
        try:
            return msgspec.msgpack.encode(obj)
        except (TypeError, OverflowError, ValueError):
            return frame[:-1]
