"""The wire format: strict decoding, typed error codes, raw tensor frames, link shaping."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from agents.protocol import (
    MAX_CONTROL_FRAME,
    PROTOCOL_VERSION,
    AgentEvent,
    DataHeader,
    EventBatch,
    LinkShape,
    LoadShard,
    PeerSpec,
    Ping,
    ProtocolError,
    StartRun,
    TensorSpec,
    decode_control,
    decode_data,
    encode_control,
)
from agents.transport import CurveKeys, LinkSender, data_message, tensor_frame, tensor_from_frame


def _code(frame: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_control(frame)
    return info.value.code


def test_control_messages_round_trip_with_their_version():
    peers = (PeerSpec(device="a", stage=0, data_address="tcp://127.0.0.1:1", public_key="k" * 40),)
    for msg in (
        Ping(req=7, t0=1.25),
        LoadShard(req=3, model_dir="/m", stage=0, start=0, end=3, peers=peers, link=LinkShape(latency_ms=5)),
        StartRun(run_id="r", mode="no-bubbles", max_new_tokens=4, micro_batches=((0,), (1,)),
                 input_ids=((1, 2), (0, 3)), attention_mask=((1, 1), (0, 1))),
        EventBatch(run_id="r", device="a", stage=0, events=(AgentEvent("compute", "decode", 2, 1, 1.0, 2.0),)),
    ):
        back = decode_control(encode_control(msg))
        assert back == msg and back.v == PROTOCOL_VERSION


def test_garbage_is_a_bad_frame():
    assert _code(b"\x00\xffgarbage\x13") == "bad_frame"
    assert _code(b"") == "bad_frame"


def test_a_frame_of_another_protocol_version_is_refused_as_such():
    assert _code(msgspec.msgpack.encode({"v": PROTOCOL_VERSION + 1, "type": "ping", "t0": 0.0})) == "bad_version"
    assert _code(msgspec.msgpack.encode({"type": "ping"})) == "bad_version"


def test_unknown_fields_types_and_tags_are_bad_messages():
    v = PROTOCOL_VERSION
    assert _code(msgspec.msgpack.encode({"v": v, "type": "ping", "t0": 0.0, "extra": 1})) == "bad_message"
    assert _code(msgspec.msgpack.encode({"v": v, "type": "ping", "t0": "soon"})) == "bad_message"
    assert _code(msgspec.msgpack.encode({"v": v, "type": "format_disk"})) == "bad_message"


def test_oversized_control_frames_are_refused_before_decoding():
    assert _code(b"\x00" * (MAX_CONTROL_FRAME + 1)) == "too_large"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensors_travel_as_raw_frames_and_come_back_equal(dtype):
    t = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 7).to(dtype)
    spec, buf = tensor_frame(t)
    header = DataHeader(run_id="r", kind="hidden", phase="decode", step=1, micro_batch=0, sender="a", tensors=(spec,))
    frames = data_message(header, [buf])
    got_header, bufs = decode_data([bytes(memoryview(f)) for f in frames], 1 << 20)
    assert got_header == header
    assert torch.equal(tensor_from_frame(spec, bufs[0]), t)


def _header(*specs):
    return DataHeader(run_id="r", kind="hidden", phase="decode", step=0, micro_batch=0, sender="a", tensors=specs)


def test_data_messages_whose_bytes_do_not_match_the_header_are_refused():
    h = msgspec.msgpack.encode(_header(TensorSpec("float32", (1, 4))))
    with pytest.raises(ProtocolError, match="needs 16 bytes"):
        decode_data([h, b"\x00" * 15], 1 << 20)
    with pytest.raises(ProtocolError, match="names 1 tensors"):
        decode_data([h], 1 << 20)
    bad = msgspec.msgpack.encode(_header(TensorSpec("complex128", (1,))))
    with pytest.raises(ProtocolError):
        decode_data([bad, b"\x00" * 16], 1 << 20)
    with pytest.raises(ProtocolError) as info:
        decode_data([h, b"\x00" * 16], 8)
    assert info.value.code == "too_large"
    with pytest.raises(ProtocolError) as info:
        decode_data([b"\xc1junk", b""], 1 << 20)
    assert info.value.code == "bad_frame"


def test_curve_keys_are_saved_owner_only_and_load_back(tmp_path):
    keys = CurveKeys.generate()
    path = tmp_path / "agent.key"
    keys.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert CurveKeys.load(path) == keys
    assert CurveKeys.load_or_create(path) == keys


def test_curve_keys_saved_over_a_world_readable_file_become_owner_only(tmp_path):
    path = tmp_path / "agent.key"
    path.write_text("old\n")
    path.chmod(0o644)
    CurveKeys.generate().save(path)
    assert path.stat().st_mode & 0o777 == 0o600


def _pair():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    return ctx, push, pull


def test_an_emulated_link_delays_by_its_latency_and_serialises_at_its_bandwidth():
    ctx, push, pull = _pair()
    sender = LinkSender(push, LinkShape(bandwidth_mbit_s=8.0, latency_ms=30.0))
    sent = []
    try:
        t0 = time.monotonic()
        for i in range(3):  # 3 x 10 kB at 8 Mbit/s = 10 ms each on the wire, then +30 ms
            sender.send([str(i).encode(), b"\x00" * 10_000], 10_000, on_sent=lambda s, e, n: sent.append((e, n)))
        returned = time.time()  # the link's clock (on_sent's times)
        arrivals = []
        for _ in range(3):
            assert pull.poll(30_000)
            pull.recv_multipart()
            arrivals.append(time.monotonic() - t0)
        assert arrivals[0] >= 0.040 - 0.002
        assert arrivals[2] >= 0.060 - 0.002
        deadline = time.monotonic() + 30  # on_sent runs on the link's thread after the frames left
        while len(sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [n for _, n in sent] == [10_000] * 3
        # send() did not block the compute thread: all three returned before the first message left
        # (an order of the link's own times, not a wall-clock bound a loaded host can overrun)
        assert returned < sent[0][0], "send() must not block the compute thread"
    finally:
        sender.close()
        ctx.destroy(linger=0)


def test_an_unshaped_link_sends_on_the_callers_thread_without_a_helper_thread():
    ctx, push, pull = _pair()
    before = threading.active_count()
    sender = LinkSender(push)
    try:
        assert threading.active_count() == before and not sender.shaped
        sender.send([b"h", b"x"], 1)
        assert pull.poll(2000)
    finally:
        sender.close()
        ctx.destroy(linger=0)


def test_a_data_socket_takes_messages_only_from_keys_the_plan_allows():
    from agents.transport import DATA_DOMAIN, KeyGate, curve_client, curve_server, start_authenticator

    ctx = zmq.Context()
    gate = KeyGate()
    server, peer, stranger = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
    gate.allow(DATA_DOMAIN, [peer.public])
    auth = start_authenticator(ctx, gate)
    try:
        pull = ctx.socket(zmq.PULL)
        curve_server(pull, server, DATA_DOMAIN)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        for keys, payload in ((stranger, b"from a stranger"), (peer, b"from the plan's peer")):
            push = ctx.socket(zmq.PUSH)
            push.linger = 0
            curve_client(push, keys, server.public)
            push.connect(f"tcp://127.0.0.1:{port}")
            push.send(payload)
        assert pull.poll(3000) and pull.recv() == b"from the plan's peer"
        assert not pull.poll(500), "the stranger's message must never arrive"
    finally:
        auth.stop()
        ctx.destroy(linger=0)


RECEIVE_WITHOUT_WARNINGS = """
import warnings
import torch, zmq
from agents.protocol import DataHeader, decode_data
from agents.transport import data_message, tensor_frame, tensor_from_frame

warnings.simplefilter("error")  # any warning fails this process
t = torch.arange(4096, dtype=torch.float32).reshape(1, 4096)
spec, buf = tensor_frame(t)
header = DataHeader(run_id="r", kind="hidden", phase="decode", step=1, micro_batch=0, sender="a", tensors=(spec,))
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
push = ctx.socket(zmq.PUSH)
push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
push.send_multipart(data_message(header, [buf]), copy=False)
frames = pull.recv_multipart(copy=False)  # what the stage loop does
_, bufs = decode_data(frames, 1 << 20)
view = tensor_from_frame(spec, bufs[0])
assert torch.equal(view, t)
view[0, 0] = 7  # the frame's own memory: no copy was made
assert torch.frombuffer(frames[1].buffer, dtype=torch.float32)[0] == 7
immutable = bytes(memoryview(buf))
copied = tensor_from_frame(spec, memoryview(immutable))  # read-only input: a writable copy
copied[0, 0] = 9
assert immutable == bytes(memoryview(buf)) and torch.equal(copied[0, 1:], t[0, 1:])
ctx.destroy(linger=0)
print("ok")
"""


def test_received_frames_become_tensors_without_warnings_and_without_a_copy():
    """Fresh interpreter: torch warns about non-writable buffers only once per process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RECEIVE_WITHOUT_WARNINGS], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
