"""Any bytes decode to a message or a ProtocolError (never another exception), and decoded
messages whose fields are out of range are refused with the field named."""

from __future__ import annotations

import msgspec
import pytest

from agents.protocol import (
    PROTOCOL_VERSION,
    DataHeader,
    LinkOptions,
    LoadShard,
    MeasureLink,
    PeerSpec,
    ProtocolError,
    SamplingSpec,
    StartRun,
    TensorSpec,
    decode_control,
    decode_data,
    encode_control,
    encode_data_header,
)

KEY = "k" * 40


def _peer(stage=0, address="tcp://127.0.0.1:5000", device="a"):
    return PeerSpec(device=device, stage=stage, data_address=address, public_key=KEY)


def _refusal(frame: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_control(frame)
    return info.value


def test_a_14_byte_frame_of_invalid_utf8_is_a_bad_frame():
    frame = b"\x82\xa1v\x01\xa4type\xa4\xff\xfe\xfd\xfc"
    assert len(frame) == 14
    assert _refusal(frame).code == "bad_frame"


def test_a_deeply_nested_frame_is_refused_as_nested_too_deeply():
    frame = b"\x82\xa1v" + b"\x91" * 200_000 + b"\x01" + b"\xa4type\xa4ping"
    err = _refusal(frame)
    assert err.code == "bad_frame" and "nested too deeply" in str(err)


def test_deep_nesting_inside_a_valid_message_is_refused_as_nested_too_deeply():
    deep = b"\x91" * 200_000 + b"\x01"
    frame = b"\x83\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa4type\xafprofile_compute\xa7options\x81\xa1x" + deep
    assert "nested too deeply" in str(_refusal(frame))


@pytest.mark.parametrize(
    "threads, field", [(10**6, "threads"), (-1, "threads")]
)
def test_load_shard_with_threads_out_of_range_is_refused(threads, field):
    msg = LoadShard(model_dir="/m", stage=0, start=0, end=2, peers=(_peer(),), threads=threads)
    err = _refusal(encode_control(msg))
    assert err.code == "bad_message" and field in str(err)


@pytest.mark.parametrize("address", ["tcp://", "udp://h:1", "tcp://h:99999", "tcp://h:0", "ipc:///tmp/x", "x" * 300])
def test_load_shard_with_a_bad_peer_address_is_refused(address):
    msg = LoadShard(model_dir="/m", stage=0, start=0, end=2, peers=(_peer(address=address),))
    err = _refusal(encode_control(msg))
    assert err.code == "bad_message" and "data_address" in str(err)


def test_load_shard_whose_peers_skip_a_stage_is_refused():
    msg = LoadShard(model_dir="/m", stage=0, start=0, end=2, peers=(_peer(0), _peer(2, device="b")))
    assert "stages 0..1" in str(_refusal(encode_control(msg)))


@pytest.mark.parametrize("timeout", [float("nan"), 1e9, -1.0, float("inf")])
def test_measure_link_with_a_nan_or_huge_timeout_is_refused(timeout):
    msg = MeasureLink(peer=_peer(), options=LinkOptions(role="send", timeout_s=timeout))
    err = _refusal(encode_control(msg))
    assert err.code == "bad_message" and "timeout_s" in str(err)


@pytest.mark.parametrize(
    "sampling, field",
    [
        (SamplingSpec(temperature=-1.0), "temperature"),
        (SamplingSpec(temperature=float("nan")), "temperature"),
        (SamplingSpec(top_p=5.0), "top_p"),
        (SamplingSpec(top_p=float("nan")), "top_p"),
        (SamplingSpec(top_p=0.0), "top_p"),
    ],
)
def test_start_run_with_sampling_out_of_range_is_refused(sampling, field):
    msg = StartRun(run_id="r", mode="sequential", max_new_tokens=2, sampling=sampling)
    err = _refusal(encode_control(msg))
    assert err.code == "bad_message" and field in str(err)


def test_start_run_whose_micro_batches_miss_a_sequence_is_refused():
    msg = StartRun(run_id="r", mode="sequential", max_new_tokens=2, micro_batches=((0,),),
                   input_ids=((1, 2), (3, 4)), attention_mask=((1, 1), (1, 1)))
    assert "micro_batches" in str(_refusal(encode_control(msg)))


def test_a_valid_start_run_with_a_lease_decodes():
    msg = StartRun(run_id="r", mode="bubbles", max_new_tokens=2, micro_batches=((0,), (1,)),
                   input_ids=((1, 2), (3, 4)), attention_mask=((1, 1), (1, 1)), lease_s=3.0)
    assert decode_control(encode_control(msg)) == msg


def _data(spec: TensorSpec, payload: bytes = b"", **fields) -> list:
    values = dict(run_id="r", kind="hidden", phase="decode", step=1, micro_batch=0, sender="a", tensors=(spec,))
    values.update(fields)
    return [encode_data_header(DataHeader(**values)), payload]


@pytest.mark.parametrize(
    "shape", [(0, 2**62, 2**62), (2**40,), (0, 2**40, 1, 1)]
)
def test_data_frames_with_overflowing_dims_are_refused_before_any_tensor_is_made(shape):
    with pytest.raises(ProtocolError):
        decode_data(_data(TensorSpec("float32", shape)), 1 << 30)


def test_a_data_frame_with_no_dims_or_a_negative_step_is_refused():
    with pytest.raises(ProtocolError):
        decode_data(_data(TensorSpec("float32", ())), 1 << 30)
    with pytest.raises(ProtocolError):
        decode_data(_data(TensorSpec("float32", (1,)), b"\0" * 4, step=-3), 1 << 30)


def test_a_deeply_nested_data_header_is_a_bad_frame():
    header = b"\x82\xa1v" + b"\x91" * 200_000 + b"\x01" + b"\xa4kind\xa6hidden"
    with pytest.raises(ProtocolError) as info:
        decode_data([header, b""], 1 << 30)
    assert info.value.code == "bad_frame"


def test_a_data_header_of_invalid_utf8_is_a_bad_frame():
    header = msgspec.msgpack.encode({"v": 1, "run_id": "r"})[:-1] + b"\xff"
    with pytest.raises(ProtocolError):
        decode_data([header[:3] + b"\xa3\xff\xfe\xfd", b""], 1 << 30)
    with pytest.raises(ProtocolError):
        decode_data([header, b""], 1 << 30)
