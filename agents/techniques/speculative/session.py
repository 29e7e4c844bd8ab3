"""A speculative run over the layer-sharding stages, greedy or sampled.

The source holds the prompt and the draft model. Per trip it proposes ``k`` tokens with the draft
(greedy), sends the last committed token and the proposals through the stages in one frame
(``VERIFY``: each stage rewinds its KV cache to the committed length first, so a rejected run of
tokens leaves no trace), and the last stage sends back its greedy token after every position
(``VERDICT``). The source accepts the longest run of proposals the target agrees with and takes the
target's next token as the bonus, so every trip commits 1..k+1 tokens, each one the target's own
greedy choice: the tokens are plain greedy decoding's by construction. Sampled (temperature > 0):
the draft draws its proposals, the last stage returns every position's logits, and the source
applies the speculative-sampling rule (``acceptance``), seeded per trip."""

from __future__ import annotations

import torch

from agents.emulation import compute_began, end_emulated
from agents.protocol import DataHeader, TokensProduced
from agents.envelope import options_of, options_slot
from agents.techniques.speculative.acceptance import accept, distribution, draw, trip_generator
from agents.techniques.speculative.messages import DRAFT_ASK, VERDICT, VERIFY, SpeculativeOptions, VerifyFrame
from agents.techniques.speculative.remote_draft import DraftLink, awaited
from agents.transport import RunAborted, data_message, tensor_frame, tensor_from_frame

ROOM = "speculative"
"""This technique's state on an agent (``Agent.room``): ``drafts`` maps a draft directory to its
loaded model; ``kept_cache`` the stage's KV cache after a ``keep_cache`` run (``ReadStageCache``)."""

GROUP = 0
"""A speculative run is one sequence: one micro-batch."""


def draft_model(agent, draft_dir: str):
    """The draft checkpoint (read from this agent's disk once, kept between runs)."""
    drafts = agent.room(ROOM).setdefault("drafts", {})
    if draft_dir not in drafts:
        from transformers import AutoModelForCausalLM

        drafts.clear()
        drafts[draft_dir] = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return drafts[draft_dir]


class Draft:
    """The draft's proposals (greedy, or drawn from its distribution with the trip's generator),
    its own KV cache kept over the tokens both models agreed on."""

    def __init__(self, model, sampling=None) -> None:
        self.model, self.cache, self.seen, self.sampling = model, None, [], sampling

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, generator=None) -> tuple[list[int], torch.Tensor | None]:
        """``k`` proposals after ``context`` and, when sampling, the draft's distributions [k, V] they were drawn from."""
        if k == 0:
            return [], None
        common = 0
        for a, b in zip(self.seen, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)
        if common == 0:
            from transformers import DynamicCache

            self.cache = DynamicCache()
        elif self.cache.get_seq_length() > common:
            self.cache.crop(common - self.cache.get_seq_length())
        feed, drafts, rows = context[common:], [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([feed]), past_key_values=self.cache, use_cache=True).logits[0, -1]
            if self.sampling is None:
                feed = [int(logits.argmax())]
            else:
                s = self.sampling
                rows.append(distribution(logits[None], s.temperature, s.top_k, s.top_p)[0])
                feed = [draw(rows[-1], generator)]
            drafts.append(feed[0])
        self.seen = context + drafts[:-1]
        return drafts, (torch.stack(rows) if rows else None)


class SpeculativeStageRun:
    """One stage's part of a speculative run (``drive``)."""

    def __init__(self, agent, loaded, msg, stop) -> None:
        self.agent, self.loaded, self.msg, self.stop = agent, loaded, msg, stop
        self.ex = loaded.executor
        self.options: SpeculativeOptions = options_of(msg.options)
        self.stage, self.n_stages = loaded.msg.stage, len(loaded.msg.peers)
        self.is_first, self.is_last = self.stage == 0, self.stage == self.n_stages - 1
        self.trips = 0
        self.accepted = 0
        self.cached = 0
        """Positions in this stage's KV cache after its last trip."""
        self.sampling = msg.sampling if msg.sampling.temperature > 0 else None
        """None: greedy (the last stage returns its argmax per position); else the last stage
        returns every position's logits and the source applies ``acceptance.accept``."""
        peers = {p.device: p for p in loaded.msg.peers}
        drafter = self.options.draft_device or loaded.source_device
        if drafter not in peers:
            raise ValueError(f"draft device {drafter!r} is not a stage of the loaded plan")
        self.draft_link = None
        """A draft on another stage (``remote_draft``): the source's link to it, or its link to the source."""
        if drafter != loaded.source_device and agent.device in (drafter, loaded.source_device):
            other = drafter if agent.device == loaded.source_device else loaded.source_device
            self.draft_link = DraftLink(agent, msg.run_id, peers[other], stop)
        self.remote_draft = None
        if drafter == agent.device and not self.is_first:  # loaded before the first ask, not during a trip
            self.remote_draft = Draft(draft_model(agent, self.options.draft_dir), self.sampling)

    # ------------------------------------------------------------------ every stage
    def serve(self) -> None:
        """A stage after the source: run every verify frame until the run is stopped."""
        while not self.stop.is_set():
            received = self.agent.receive_data(1 << 30, timeout_ms=None)
            if received is None:
                continue
            header, bufs, _ = received
            if header.run_id == self.msg.run_id and header.kind == DRAFT_ASK and self.remote_draft is not None:
                seed = None if self.sampling is None else self.sampling.seed
                self.draft_link.answer(self.remote_draft, header, bufs, seed)
                continue
            if header.run_id != self.msg.run_id or header.kind != VERIFY or len(header.tensors) not in (1, 2):
                continue  # a straggler of another run, a probe, or a frame this run never sends
            x = tensor_from_frame(header.tensors[0], bufs[0])
            mask = tensor_from_frame(header.tensors[1], bufs[1]) if len(header.tensors) > 1 else None
            self._through(header.step, x, options_of(header.options).keep, mask)
        raise RunAborted()

    def _through(self, step: int, x: torch.Tensor, keep: int, mask) -> torch.Tensor | None:
        """This stage's compute of a trip, sent on (the last stage sends its greedy tokens back);
        on a one-stage plan the tokens themselves."""
        phase = "prefill" if mask is not None else "decode"
        t0 = self.agent.clock()
        if mask is None and keep < self.cached:  # proposals rejected last trip: the rewind drops them
            self.ex.rewind(GROUP, keep)
            self.agent._event("rollback", phase, step, GROUP, t0, self.agent.clock(), self.cached - keep)
            t0 = self.agent.clock()
        out = self.ex.prefill(GROUP, x, mask) if mask is not None else self.ex.decode_positions(GROUP, x, keep)
        self.cached = keep + x.shape[1]
        if self.is_last:
            out = out.argmax(-1).to(torch.int64).reshape(1, -1) if self.sampling is None else out.reshape(-1, out.shape[-1])
        self.agent._event("compute", phase, step, GROUP, t0, self.agent.clock())
        if self.n_stages == 1:
            return out
        tensors = [out] if mask is None or self.is_last else [out, mask.to(torch.int64)]
        specs, bufs = zip(*(tensor_frame(t) for t in tensors))
        kind = VERDICT if self.is_last else VERIFY
        header = DataHeader(run_id=self.msg.run_id, kind=kind, phase=phase, step=step, micro_batch=GROUP,
                            sender=self.agent.device, tensors=tuple(specs), t_sent=self.agent.clock(),
                            options=options_slot(None if self.is_last else VerifyFrame(keep=keep)))
        peer, agent = self.loaded.next_device, self.agent

        def on_sent(start: float, end: float, n: int) -> None:
            agent._event("send", phase, step, GROUP, start, end, n, peer)

        self.loaded.sender.send(data_message(header, list(bufs)), sum(s.nbytes() for s in specs), on_sent, self.stop)
        return None

    # ------------------------------------------------------------------ the source
    def _trip(self, step: int, x: torch.Tensor, keep: int, mask=None) -> torch.Tensor:
        """One trip through every stage: the target's greedy token after each position of ``x``
        (int64 [n]), or when sampling its logits there ([n, V])."""
        got = self._through(step, x, keep, mask)
        if got is None:
            got = awaited(self.agent, self.msg.run_id, VERDICT, step, self.stop)[0]
        self.agent._wake_for_outbox()
        return got.reshape(-1) if self.sampling is None else got.reshape(-1, got.shape[-1])

    def generate(self) -> tuple[tuple[int, ...], ...]:
        msg = self.msg
        if len(msg.input_ids) != 1:
            raise ValueError(f"a speculative run decodes one sequence, got {len(msg.input_ids)}")
        prompt = list(msg.input_ids[0])
        if not all(msg.attention_mask[0]):
            raise ValueError("a speculative run's prompt carries no padding")
        draft = None if self.draft_link else Draft(draft_model(self.agent, self.options.draft_dir), self.sampling)
        eos, budget, k, s = set(msg.eos_token_ids), msg.max_new_tokens, self.options.k, self.sampling
        ids = torch.tensor([prompt], dtype=torch.int64)
        out: list[int] = []
        step = 0
        first = self._trip(step, ids, 0, torch.ones_like(ids))[-1:]
        new = [int(first[0])] if s is None else [draw(distribution(first, s.temperature, s.top_k, s.top_p)[0],
                                                      trip_generator(s.seed, 0))]
        while True:
            arrived = self.agent.clock()  # a trip's tokens arrive together: one time (how trips are told apart)
            for token in new:  # committed: stop at EOS or the budget
                out.append(token)
                self.agent._post(TokensProduced(run_id=msg.run_id, micro_batch=GROUP, step=len(out) - 1,
                                                sequence_ids=(0,), token_ids=(token,), t=arrived), wake=False)
                if token in eos or len(out) >= budget:
                    if self.options.keep_cache:  # the committed tokens' cache on every stage, nothing more
                        self._trip(step + 1, torch.tensor([[out[-1]]]), len(prompt) + len(out) - 1)
                    return (tuple(out),)
            step += 1
            generator = None if s is None else trip_generator(s.seed, step)
            n = min(k, budget - len(out) - 1)
            if draft is None:  # the draft's device proposes (and records its draft event)
                proposals, q = self.draft_link.ask(step, prompt + out, n, s is not None) if n else ([], None)
                for row in () if q is None else q:  # the draws the draft made on its copy of the trip's generator:
                    draw(row, generator)  # the acceptance's draws follow them, as with the draft here
            else:
                t0, began = self.agent.clock(), compute_began()
                proposals, q = draft.propose(prompt + out, n, generator)
                end_emulated(self.agent.emulation.compute_slowdown, began)  # drafting on an emulated device: its speed
                self.agent._event("draft", "decode", step, GROUP, t0, self.agent.clock(), len(proposals))
            verdict = self._trip(step, torch.tensor([[out[-1], *proposals]], dtype=torch.int64),
                                 len(prompt) + len(out) - 1)
            if s is None:
                agreed = 0
                while agreed < len(proposals) and proposals[agreed] == int(verdict[agreed]):
                    agreed += 1
                new = proposals[:agreed] + [int(verdict[agreed])]
            else:
                p = distribution(verdict, s.temperature, s.top_k, s.top_p)
                new = accept(p, q if q is not None else p[:0], proposals, generator)
                agreed = len(new) - 1
            self.trips += 1
            self.accepted += agreed


def drive(agent, loaded, msg, stop):
    """The run driver of ``StartRun`` with ``SpeculativeOptions``."""
    run = SpeculativeStageRun(agent, loaded, msg, stop)
    try:
        if run.is_first:
            return run.generate()
        run.serve()
    finally:
        if run.draft_link is not None:
            run.draft_link.close()
        room = agent.room(ROOM)
        room.pop("kept_cache", None)
        if run.options.keep_cache and GROUP in run.ex.groups():
            room["kept_cache"] = run.ex.cached(GROUP)
        run.ex.drop(GROUP)
    return ()
