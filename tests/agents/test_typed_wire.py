"""The wire's typed parts: agent states, profiling options and results, and version errors.

An unknown state, a free-form result or an out-of-range option is a decode error naming the
field; a frame of another protocol version names both versions and the upgrade command."""

from __future__ import annotations

import math

import msgspec
import pytest

from agents.protocol import (
    PROTOCOL_VERSION,
    AgentState,
    AgentStatus,
    ComputeOptions,
    ComputeProfile,
    ConvSweepOptions,
    ConvTimings,
    DataHeader,
    LinkOptions,
    LinkResult,
    MeasureLink,
    PeerSpec,
    ProfileCompute,
    ProfileResult,
    ProtocolError,
    TensorSpec,
    UnitTimes,
    VersionMismatch,
    decode_control,
    decode_data,
    encode_control,
    encode_data_header,
)

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
PEER = PeerSpec(device="b", stage=0, data_address="tcp://127.0.0.1:5000", public_key="k" * 40)
UNIT = UnitTimes(unit=1, decode_s=(1e-3, 2e-3), decode_spread=(0.01, 0.02), prefill_s=(5e-3,), prefill_spread=(0.1,),
                 param_bytes=4096)
PROFILE = ComputeProfile(device="a", decode_batch_sizes=(1, 2), prefill_token_counts=(32,), units=(UNIT,),
                         memory_budget_bytes=1 << 30, memory_total_bytes=2 << 30, memory_available_bytes=1 << 30,
                         accelerator="", threads=2, seconds=1.5)


def _status(state) -> dict:
    return {"v": PROTOCOL_VERSION, "type": "status", "req": 1, "device": "a", "agent_version": "0.1.0",
            "state": state, "public_key": "k" * 40, "data_address": "tcp://127.0.0.1:5000"}


def _refusal(frame: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_control(frame)
    return info.value


def test_an_agent_status_decodes_its_state_as_the_named_value():
    status = decode_control(msgspec.msgpack.encode(_status("loading")))
    assert isinstance(status, AgentStatus) and status.state is AgentState.LOADING


def test_an_agent_state_reads_as_the_string_the_studio_shows():
    assert [f"{s}" for s in AgentState] == ["idle", "loading", "ready", "running", "failed"]
    assert AgentState.RUNNING == "running"


def test_an_unknown_agent_state_is_a_bad_message_naming_the_field():
    err = _refusal(msgspec.msgpack.encode(_status("sleeping")))
    assert err.code == "bad_message" and "state" in str(err) and "sleeping" in str(err)


@pytest.mark.parametrize("result", [PROFILE, ConvTimings(samples=((1e6, 1e-4), (4e6, 3e-4))),
                                    LinkResult(role="receive", probe_id="p", bytes_received=10, bandwidth_mbit_s=9.5,
                                               one_way_s=(-0.001, 0.002), seconds=0.1)])
def test_each_profiling_result_decodes_to_its_own_type(result):
    back = decode_control(encode_control(ProfileResult(req=4, result=result)))
    assert isinstance(back, ProfileResult) and type(back.result) is type(result) and back.result == result


def test_a_profiling_result_given_as_a_free_form_map_is_a_bad_message():
    frame = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "profile_result", "req": 2,
                                    "result": {"device": "a", "samples": [[1.0, 2.0]]}})
    assert _refusal(frame).code == "bad_message"


def test_a_compute_profile_with_a_time_missing_for_a_batch_size_is_refused():
    short = msgspec.structs.replace(UNIT, decode_s=(1e-3,))
    err = _refusal(encode_control(ProfileResult(result=msgspec.structs.replace(PROFILE, units=(short,)))))
    assert err.code == "bad_message" and "unit 1" in str(err)


@pytest.mark.parametrize("bad", [math.nan, -1e-3, math.inf])
def test_a_compute_profile_with_a_time_that_is_not_a_finite_non_negative_number_is_refused(bad):
    unit = msgspec.structs.replace(UNIT, prefill_s=(bad,))
    err = _refusal(encode_control(ProfileResult(result=msgspec.structs.replace(PROFILE, units=(unit,)))))
    assert err.code == "bad_message" and "finite" in str(err)


def test_conv_timings_with_a_nan_are_refused():
    err = _refusal(encode_control(ProfileResult(result=ConvTimings(samples=((1e6, math.nan),)))))
    assert err.code == "bad_message" and "conv timings" in str(err)


def test_profile_compute_options_are_one_of_two_kinds_told_apart_by_their_tag():
    for options in (ComputeOptions(config=CONFIG, batch_sizes=(1, 4)), ConvSweepOptions(sizes=(8, 16))):
        back = decode_control(encode_control(ProfileCompute(req=1, options=options)))
        assert back.options == options
    raw = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "profile_compute", "options": {"repeats": 3}})
    assert _refusal(raw).code == "bad_message"  # no kind: neither


@pytest.mark.parametrize("options, field", [
    (ComputeOptions(config={"hidden_size": 8}), "model_type"),
    (ComputeOptions(config=CONFIG, repeats=0), "repeats"),
    (ComputeOptions(config=CONFIG, batch_sizes=()), "batch_sizes"),
    (ComputeOptions(config=CONFIG, batch_sizes=(1 << 20,)), "batch_sizes"),
    (ComputeOptions(config=CONFIG, prompt_tokens=0), "prompt_tokens"),
    (ComputeOptions(config=CONFIG, dtype="int8"), "dtype"),
    (ComputeOptions(config=CONFIG, device="tpu"), "device"),
    (ComputeOptions(config=CONFIG, threads=10**6), "threads"),
    (ConvSweepOptions(sizes=(100_000,)), "conv-sweep options"),
    (ConvSweepOptions(channels=()), "conv-sweep options"),
    (ConvSweepOptions(repeats=500), "conv-sweep options"),
])
def test_profile_compute_options_out_of_range_are_refused_naming_the_field(options, field):
    err = _refusal(encode_control(ProfileCompute(req=1, options=options)))
    assert err.code == "bad_message" and field in str(err)


@pytest.mark.parametrize("options, field", [
    (LinkOptions(role="send", nbytes=0), "nbytes"),
    (LinkOptions(role="send", chunk_bytes=1 << 30), "chunk_bytes"),
    (LinkOptions(role="receive", probe_id=""), "probe_id"),
    (LinkOptions(role="receive", warmup_fraction=1.0), "warmup_fraction"),
    (LinkOptions(role="send", latency_gap_s=math.nan), "latency_gap_s"),
])
def test_link_options_out_of_range_are_refused_naming_the_field(options, field):
    err = _refusal(encode_control(MeasureLink(peer=PEER, options=options)))
    assert err.code == "bad_message" and field in str(err)


def test_a_link_probe_must_say_whether_it_sends_or_receives():
    raw = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "measure_link", "peer": msgspec.to_builtins(PEER),
                                  "options": {"role": "both"}})
    assert _refusal(raw).code == "bad_message"


def test_a_frame_of_the_previous_version_names_both_versions_and_the_upgrade_command():
    frame = msgspec.msgpack.encode({"v": PROTOCOL_VERSION - 1, "type": "get_status", "req": 12})
    err = _refusal(frame)
    assert isinstance(err, VersionMismatch) and err.code == "bad_version"
    assert f"version {PROTOCOL_VERSION - 1} received" in str(err)
    assert f"version {PROTOCOL_VERSION} supported" in str(err)
    assert "edgeshard agents upgrade" in str(err)
    assert (err.received, err.req, err.reply_version) == (PROTOCOL_VERSION - 1, 12, PROTOCOL_VERSION - 1)


@pytest.mark.parametrize("v", [PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION - 1), None, 0])
def test_a_frame_of_a_newer_or_unreadable_version_is_answered_in_ours(v):
    err = _refusal(msgspec.msgpack.encode({"v": v, "type": "ping", "req": "x"}))
    assert isinstance(err, VersionMismatch) and err.reply_version == PROTOCOL_VERSION and err.req == 0


def test_a_data_header_of_the_previous_version_names_both_versions():
    header = DataHeader(v=PROTOCOL_VERSION - 1, run_id="r", kind="hidden", phase="decode", step=1, micro_batch=0,
                        sender="a", tensors=(TensorSpec("float32", (1, 2)),))
    with pytest.raises(VersionMismatch) as info:
        decode_data([encode_data_header(header), b"\x00" * 8], 1 << 20)
    assert f"version {PROTOCOL_VERSION - 1}" in str(info.value) and f"version {PROTOCOL_VERSION}" in str(info.value)
