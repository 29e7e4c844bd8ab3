"""The draft on a stage other than the source (``SpeculativeOptions.draft_device``).

Why a stage: its agent is loaded with the plan, so its data socket already accepts the source's key
and the source's its key (``Agent._allow_stage_peers``); the draft runs between trips, while every
stage waits for the next verify, so it takes no stage's compute time. Per trip the source sends the
tokens committed since its last ask (``DRAFT_ASK``, ``DraftAsk``) and the draft's device sends back
its proposals (``PROPOSALS``; when sampling, with the draft's distributions, drawn with the same
per-trip generator the source would use): the tokens are exactly those of a draft on the source."""

from __future__ import annotations

import torch

from agents.emulation import compute_began, end_emulated
from agents.envelope import options_of, options_slot
from agents.protocol import DataHeader
from agents.techniques.speculative.acceptance import trip_generator
from agents.techniques.speculative.messages import DRAFT_ASK, PROPOSALS, DraftAsk
from agents.transport import PeerSenders, RunAborted, data_message, tensor_frame, tensor_from_frame

GROUP = 0


def awaited(agent, run_id: str, kind: str, step: int, stop, n_tensors: int = 1) -> list[torch.Tensor]:
    """The tensors of this run's next ``kind`` frame of ``step`` (other frames are stragglers: dropped)."""
    while True:
        if stop.is_set():
            raise RunAborted()
        received = agent.receive_data(1 << 30, timeout_ms=None)
        if received is None:
            continue
        header, bufs, _ = received
        if header.run_id == run_id and header.kind == kind and header.step == step \
                and len(header.tensors) >= n_tensors:
            return [tensor_from_frame(spec, buf) for spec, buf in zip(header.tensors, bufs)]


class DraftLink:
    """One end of the source <-> draft-device exchange of a run: the source's ``ask`` or the draft
    device's ``answer``; ``peer`` is the other end's ``PeerSpec``."""

    def __init__(self, agent, run_id: str, peer, stop) -> None:
        from agents.agent import SEND_TIMEOUT_MS

        self.agent, self.run_id, self.peer, self.stop = agent, run_id, peer, stop
        self.senders = PeerSenders(agent.context, agent.keys, SEND_TIMEOUT_MS, clock=agent.clock, counts=agent.wire)
        self.known = 0
        """Source: context tokens the draft's device holds. Draft's device: unused."""
        self.context: list[int] = []
        """Draft's device: the committed context it drafts after."""

    def close(self) -> None:
        self.senders.close()

    def _send(self, kind: str, step: int, tensors: list[torch.Tensor], options) -> None:
        specs, bufs = zip(*(tensor_frame(t) for t in tensors))
        header = DataHeader(run_id=self.run_id, kind=kind, phase="decode", step=step, micro_batch=GROUP,
                            sender=self.agent.device, tensors=tuple(specs), t_sent=self.agent.clock(),
                            options=options_slot(options))
        agent, peer = self.agent, self.peer.device

        def on_sent(start: float, end: float, n: int) -> None:
            agent._event("send", "decode", step, GROUP, start, end, n, peer)

        sender = self.senders.to(peer, self.peer, agent.default_link)
        sender.send(data_message(header, list(bufs)), sum(s.nbytes() for s in specs), on_sent, self.stop)

    # ------------------------------------------------------------------ the source
    def ask(self, step: int, context: list[int], n: int, sampled: bool) -> tuple[list[int], torch.Tensor | None]:
        """``n`` proposals after ``context`` from the draft's device (and its distributions when ``sampled``)."""
        fresh = torch.tensor([context[self.known:]], dtype=torch.int64)
        self._send(DRAFT_ASK, step, [fresh], DraftAsk(keep=self.known, n=n))
        self.known = len(context)
        tensors = awaited(self.agent, self.run_id, PROPOSALS, step, self.stop, 2 if sampled else 1)
        return [int(t) for t in tensors[0].reshape(-1).tolist()], tensors[1] if sampled else None

    # ------------------------------------------------------------------ the draft's device
    def answer(self, draft, header, bufs, seed: int | None) -> None:
        """Propose after the context a ``DRAFT_ASK`` completes, timed and slowed as the source's
        drafting is, and send the proposals back."""
        ask: DraftAsk = options_of(header.options)
        if ask.keep > len(self.context):
            raise ValueError(f"a draft ask keeps {ask.keep} tokens, the draft's device holds {len(self.context)}")
        self.context = self.context[:ask.keep] + tensor_from_frame(header.tensors[0], bufs[0]).reshape(-1).tolist()
        generator = None if seed is None else trip_generator(seed, header.step)
        t0, began = self.agent.clock(), compute_began()
        proposals, q = draft.propose(self.context, ask.n, generator)
        end_emulated(self.agent.emulation.compute_slowdown, began)
        self.agent._event("draft", "decode", header.step, GROUP, t0, self.agent.clock(), len(proposals))
        tensors = [torch.tensor(proposals, dtype=torch.int64)] + ([] if q is None else [q.to(torch.float32)])
        self._send(PROPOSALS, header.step, tensors, None)
