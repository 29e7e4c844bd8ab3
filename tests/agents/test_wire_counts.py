"""An agent counts what its sockets sent, per link and kind: the counts are what the receiving
socket got (a real PUSH/PULL pair), and a run's share on real agent processes is the difference
of two statuses."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from agents.protocol import DataHeader, TensorSpec
from agents.transport import LinkSender, WireCounts, data_message, harden


def _message(kind: str, n: int) -> list:
    header = DataHeader(run_id="r1", kind=kind, phase="decode", step=1, micro_batch=0, sender="a",
                        tensors=(TensorSpec("float32", (n,)),))
    return data_message(header, [np.arange(n, dtype=np.float32)])


@pytest.mark.parametrize("named", [False, True], ids=["read-from-header", "named-by-sender"])
def test_the_counts_are_the_bytes_the_receiving_socket_got_per_kind(named):
    """Whether the kind is read back from the header or named by the sender (the stage loop's sends)."""
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        harden(pull), harden(push)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        counts = WireCounts()
        sender = LinkSender(push, counts=counts, link="b")
        sent = [("hidden", 64), ("tokens", 3), ("hidden", 1000)]
        for kind, n in sent:
            sender.send(_message(kind, n), n * 4, kind=kind if named else None)
        got: dict[str, tuple[int, int]] = {}
        for kind, _ in sent:
            frames = pull.recv_multipart()
            m, b = got.get(kind, (0, 0))
            got[kind] = (m + 1, b + sum(len(f) for f in frames))
        assert {(c.link, c.kind): (c.messages, c.nbytes) for c in counts.snapshot()} == {
            ("b", kind): v for kind, v in got.items()}
        assert got["hidden"][1] > (64 + 1000) * 4  # the headers are on the wire too
    finally:
        ctx.destroy(linger=0)


def test_a_header_that_does_not_decode_is_counted_under_an_unknown_kind():
    counts = WireCounts()
    counts.add_data("b", [b"\xff\x00", b"abcd"])
    assert [(c.kind, c.messages, c.nbytes) for c in counts.snapshot()] == [("?", 1, 6)]
