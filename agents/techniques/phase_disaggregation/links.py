"""EPD's data plane on an agent: the multimodal tokens and KV caches its phases push to each other
(``mm`` / ``kv`` data frames), held in a bounded store until their request takes them."""

from __future__ import annotations

import time

import torch

from agents.techniques.phase_disaggregation.messages import MAX_RNG_STATE


class PhaseRequestError(ValueError):
    """A phase request this executor cannot serve (wrong shapes, wrong phase): named in the reply."""


MAX_HELD_BYTES = 512 << 20
"""What a phase agent keeps of tensors that arrived before their request (its side of the
multimodal / KV cache); the coordinator reserves room before sending, so more is a peer's error."""
TAKE_TIMEOUT_S = 60.0
HANDOFF_PIECE = 1
"""The ``kv`` piece beside the KV cache (piece 0): the first token and the sampler state, so a
decode agent starts when they arrive, not when the coordinator hears from the prefill agent."""


def handoff_tensor(token: int, rng: bytes) -> torch.Tensor:
    """The first token, the sampler state's length and its bytes packed four to a float32 (a bit view,
    never arithmetic: exact). One float per byte made the 5,056-byte state of a CPU generator 20 KB a
    request, more than a tiny model's whole KV cache; a greedy prefill sends no state at all."""
    if not 0 <= token < 1 << 24:
        raise PhaseRequestError(f"a token id {token} does not travel as a float32 handoff (below 2**24 only)")
    if len(rng) > MAX_RNG_STATE:
        raise PhaseRequestError(f"a sampler state of {len(rng)} bytes is more than a handoff carries ({MAX_RNG_STATE})")
    packed = torch.frombuffer(bytearray(rng + b"\0" * (-len(rng) % 4)), dtype=torch.float32) if rng else torch.empty(0)
    return torch.cat((torch.tensor([token, len(rng)], dtype=torch.float32), packed))


def from_handoff(t: torch.Tensor) -> tuple[int, bytes]:
    """``handoff_tensor``'s inverse; ``PhaseRequestError`` for a vector that is not one."""
    v = t.reshape(-1).contiguous()
    head = v[:2]
    if v.numel() < 2 or not torch.equal(head, head.round()) or float(head.min()) < 0 \
            or float(v[0]) >= 1 << 24 or float(v[1]) > MAX_RNG_STATE or v.numel() != 2 + (int(v[1]) + 3) // 4:
        raise PhaseRequestError("the prefill agent's handoff is not a token and sampler-state bytes")
    return int(v[0]), v[2:].view(torch.uint8)[:int(v[1])].numpy().tobytes()


class PhaseLinks:
    """An agent's EPD data plane: pushes tensors to its pool peers' data sockets (Curve, raw frames
    beside a checked header, through the emulated link) and keeps what arrives for its requests in
    a bounded store until a request takes it. One per loaded phase stage."""

    def __init__(self, agent, peers) -> None:
        self.agent = agent
        self.peers = {p.device: p for p in peers}
        self.held: dict[tuple[str, str, int, int], tuple[torch.Tensor, float]] = {}
        """(run, kind, request, piece) -> (tensor, arrival time on this agent's clock)."""
        self.held_bytes = 0
        self.run = ""
        self.ended: set[str] = set()
        """Runs whose pieces were dropped: a late piece of one is dropped on arrival (never ``"epd"``, the
        id of requests that name no run)."""
        from agents.transport import PeerSenders

        self._senders = PeerSenders(agent.context, agent.keys, 1000, clock=agent.clock, counts=agent.wire)

    def close(self) -> None:
        self._senders.close()

    def begin(self, run: str) -> None:
        """A request of ``run`` is served: the pieces earlier runs left here are stale (a failed run's),
        dropped so that none feeds this run's request of the same index."""
        run = run or "epd"
        if run == self.run:
            return
        if self.run:
            self.ended.add(self.run)
        self.run = run
        for key in [k for k in self.held if k[0] != run]:
            self.held_bytes -= self.held.pop(key)[0].numel() * 4
            self.ended.add(key[0])
        self.ended.discard("epd")  # the id of probes that name no run (profiling) is used again and again

    def send(self, device: str, kind: str, run: str, request: int, piece: int, x: torch.Tensor) -> None:
        """Push ``x`` to ``device``'s store; to this agent itself (a coupled stage handing one phase's
        product to its next phase), straight into its own store: nothing crosses a link."""
        from agents.protocol import DataHeader
        from agents.transport import data_message, tensor_frame

        if device not in self.peers:
            raise PhaseRequestError(f"{device!r} is not a peer of this stage's pools")
        if device == self.agent.device:
            if not self._hold((run or "epd", kind, request, piece), x.float().contiguous(), self.agent.clock()):
                raise PhaseRequestError(f"{kind} piece {piece} of request {request} does not fit this agent's store "
                                        f"({MAX_HELD_BYTES} B): the coordinator sent more than its caches hold")
            return
        sender = self._senders.to(device, self.peers[device], self.agent.default_link)
        spec, buf = tensor_frame(x.float().contiguous())
        header = DataHeader(run_id=run or "epd", kind=kind, phase="prefill", step=request, micro_batch=piece,
                            sender=self.agent.device, tensors=(spec,), t_sent=self.agent.clock())
        sender.send(data_message(header, [buf]), spec.nbytes())

    def _hold(self, key: tuple[str, str, int, int], t: torch.Tensor, when: float) -> bool:
        """Keep ``t`` for its request if the store has room (bounded: ``MAX_HELD_BYTES``)."""
        nbytes = t.numel() * 4
        if key in self.held or self.held_bytes + nbytes > MAX_HELD_BYTES:
            return False
        self.held[key] = (t, when)
        self.held_bytes += nbytes
        return True

    def has(self, kind: str, run: str, request: int, pieces) -> bool:
        return all((run or "epd", kind, request, p) in self.held for p in pieces)

    def receive(self, timeout_ms: int | None = None) -> bool:
        """Keep one data message that arrived (waiting at most ``timeout_ms``; None: the socket's own
        timeout); False when none came. A message that is not an expected EPD piece is dropped and logged."""
        import zmq

        from agents.protocol import ProtocolError, decode_data
        from agents.transport import tensor_from_frame

        sock = self.agent.data_socket
        try:
            if timeout_ms is not None and not sock.poll(timeout_ms):
                return False
            frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK if timeout_ms is not None else 0)
        except zmq.Again:
            return False
        got = self.agent.clock()
        try:
            header, bufs = decode_data(frames, MAX_HELD_BYTES)
        except ProtocolError as err:
            self.agent.log(f"dropped data message: {err.code}: {err}")
            return True
        key = (header.run_id, header.kind, header.step, header.micro_batch)
        if header.run_id in self.ended:
            self.agent.log(f"dropped a stale {header.kind} piece of request {header.step} of ended run {header.run_id}")
            return True
        if header.kind not in ("mm", "kv") or header.sender not in self.peers \
                or len(header.tensors) != 1 or header.tensors[0].dtype != "float32" or key in self.held:
            self.agent.log(f"dropped a data message from {header.sender!r}: not an expected EPD piece")
            return True
        if header.tensors[0].nbytes() + self.held_bytes > MAX_HELD_BYTES:
            self.agent.log(f"dropped {header.kind} piece of request {header.step}: the store is full")
            return True
        self._hold(key, tensor_from_frame(header.tensors[0], bufs[0]).clone(), got)
        return True

    def pop(self, kind: str, run: str, request: int, pieces) -> dict:
        """The held pieces of ``request`` of ``run``: piece → (tensor, arrival time on this agent's clock)."""
        out = {}
        for p in sorted(pieces):
            t, when = self.held.pop((run or "epd", kind, request, p))
            self.held_bytes -= t.numel() * 4
            out[p] = (t, when)
        return out

    def take(self, kind: str, run: str, request: int, pieces, timeout_s: float = TAKE_TIMEOUT_S) -> dict:
        """The pieces of ``request`` (tensor, arrival time on this agent's clock), receiving until all
        are here; ``PhaseRequestError`` naming what is missing after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.has(kind, run, request, pieces):
            if time.monotonic() > deadline:
                raise PhaseRequestError(self.missing(kind, run, request, pieces, timeout_s))
            self.receive()
        return self.pop(kind, run, request, pieces)

    def missing(self, kind: str, run: str, request: int, pieces, timeout_s: float) -> str:
        gone = sorted(p for p in pieces if (run or "epd", kind, request, p) not in self.held)
        return (f"{kind} pieces {gone} of request {request} did not arrive within {timeout_s:g} s (is the "
                f"sending agent up and its link working?)")


def _links(links: PhaseLinks | None) -> PhaseLinks:
    if links is None:
        raise PhaseRequestError("this request moves tensors over the data plane, which only an agent has")
    return links
