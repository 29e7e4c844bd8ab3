"""Attention offloading's staggered pipelining on agents: several compute replicas, one memory pool.

Each compute replica holds the whole dense part (no KV); the run's micro-batches go slice by slice
over them as ``schedule.staggered_slices`` says (fixed: a batch stays on its replica;
rotational: consecutive slices of a batch move from replica to replica), and every replica
performs its own slices in that order. A slice ends at an attention: its q, k, v go to the
memory agents (``attend`` frames naming ``reply_to``: the replica of the batch's next slice),
its residual stream (and the tokens sampled so far) to that replica (``residual`` frame), and
the forward pass is unwound. The next slice resumes the block from the residual and the
attention outputs: transformers' attention registry hands back the received output, and the
block's q/k/v projections are swapped for zeros of their width for that call (their result
is not needed: the memory agents already attended), so no work is done twice and no model code
is patched. A replica knows every batch's prompt mask, so masks, positions and rotary
embeddings of any (batch, step) are computed where the slice runs; sampling draws from
``step_generator(seed, batch, step)``, a function of the position only, so it does not matter
which replica samples. Replica 0 is the run's source stage (a ``StartRun`` whose options are a ``StaggeredSpec``): it starts
the others (``start`` frames), runs every batch's tail (the last step's head) and reports the
tokens; the others are held (``HoldDense``). Each slice is a ``compute`` span on its replica and
each frame a ``send``, the same events the simulator (core.techniques.attention_offload.
simulator) predicts from the same schedule. A batch's finished sequences are fed the pad token,
as the pipeline does; once every sequence of a batch hit EOS, the replica that sampled it tells
the others (a ``tokens`` frame) and the batch's later slices are skipped everywhere: no compute,
no memory-agent work, no transfers (tokens stay HF generate's, which pads after EOS).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from agents.emulation import compute_began, end_emulated
from agents.envelope import options_of, options_slot
from agents.stage_input import StageInputError
from agents.techniques.attention_offload.data_plane import (
    ATTEND_TIMEOUT_S, PEER_DOWN_S, MemorySideSilent, _clock_event, _Covers, lost_connection, mask_mode, side_frames,
)
from agents.techniques.attention_offload.heads import DenseExecutor, HeadShape, _lengths_only_layer_class
from agents.techniques.attention_offload.messages import AttendSpec
from agents.techniques.attention_offload.schedule import slice_replica, staggered_slices


class _Suspended(Exception):
    """Raised by the attention function once a slice's q, k, v are captured: unwinds the forward."""


class SliceRouter:
    """The dense executor's attention side during a staggered run: captures a slice's q, k, v (and
    suspends), or hands back the attention output a resumed block is given."""

    def __init__(self):
        self.resume_with: torch.Tensor | None = None
        self.captured: tuple | None = None
        self.calls = 0

    def attend(self, group, layer, query, key, value, mask, scaling):
        if self.resume_with is not None:
            out, self.resume_with = self.resume_with, None
            return out
        self.captured = (layer, query, key, value, mask, scaling)
        self.calls += 1
        raise _Suspended()

    def drop(self, group, layers=None) -> None:
        pass


class _Zeros(nn.Module):
    """Stands in for a q/k/v projection while a block resumes after its attention."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.width)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "c_attn")


@contextlib.contextmanager
def _projections_skipped(attention: nn.Module):
    saved = {n: getattr(attention, n) for n in _PROJECTIONS if isinstance(getattr(attention, n, None), nn.Module)}
    for name, module in saved.items():
        width = getattr(module, "out_features", None) or getattr(module, "nf")
        setattr(attention, name, _Zeros(int(width)))
    try:
        yield
    finally:
        for name, module in saved.items():
            setattr(attention, name, module)


@dataclass
class _StepInputs:
    past: int
    positions: torch.Tensor
    masks: dict
    extra: dict
    cache: object


@dataclass(frozen=True)
class RunInputs:
    """What every replica knows of the run: prompts, micro-batches, steps, sampling."""

    run_id: str
    micro_batches: tuple[tuple[int, ...], ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    steps: int
    eos: frozenset
    pad: int
    sampling: object
    """agents.protocol.SamplingSpec"""


class StaggeredReplica:
    """Replica ``me`` of ``replicas`` (PeerSpecs, replica 0 first) performing its slices."""

    def __init__(self, agent, executor: DenseExecutor, *, me: int, schedule: str, replicas, services,
                 run: RunInputs, stop, link=None):
        from agents.transport import PeerSenders

        self.agent, self.ex, self.me, self.stop = agent, executor, me, stop
        self.replicas = tuple(replicas)
        self.services = sorted(services, key=lambda s: s.start)
        self.run = run
        self.schedule = schedule
        self.layers = executor.num_layers
        self.n = len(run.micro_batches)
        self.order = [s for s in staggered_slices(schedule, len(self.replicas), self.n, run.steps, self.layers)
                      if s.replica == me]
        self.link = link if link is not None else agent.default_link
        self._senders = PeerSenders(agent.context, agent.keys, 200, clock=agent.clock, monitor_connections=True,
                                    counts=agent.wire)
        self._inbox: dict[tuple[int, int], dict] = {}
        self._steps: dict[tuple[int, int], _StepInputs] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        """Replica 0: every batch's sampled ids [B, steps] once its tail ran (fewer: it finished early)."""
        self.finished: dict[int, torch.Tensor] = {}
        """Batches whose every sequence hit EOS before their last step: their tokens then."""
        if run.sampling.uses_history:
            raise ValueError("staggered attention offloading samples without a repetition penalty or n-gram ban "
                             "(not supported): run with repetition_penalty 1 and no_repeat_ngram_size 0")
        self._sample = agent.sampler_factory(run.sampling)
        self.router = SliceRouter()
        self.shape = executor.shape

    def close(self) -> None:
        self._senders.close()

    def _send(self, peer, frames, nbytes: int, step: int, group: int) -> None:
        agent = self.agent

        def on_sent(start, end, n, device=peer.device):
            _clock_event(agent, "send", step, group, start, end, n, device)

        self._senders.to(peer.device, peer, self.link).send(frames, nbytes, on_sent, self.stop)

    # ------------------------------------------------------------------ the loop
    def start_others(self) -> None:
        """Replica 0: tell the held replicas the run began (its id)."""
        from agents.protocol import DataHeader
        from agents.transport import data_message

        for peer in self.replicas[1:]:
            header = DataHeader(run_id=self.run.run_id, kind="start", phase="prefill", step=0, micro_batch=0,
                                sender=self.agent.device, tensors=(), t_sent=self.agent.clock())
            frames = data_message(header, [])
            self._senders.to(peer.device, peer, self.link).send(frames, len(frames[0]), lambda *a: None, self.stop)

    def perform(self) -> None:
        """Every slice of this replica, in the schedule's order."""
        ex = self.ex
        saved = ex.router
        ex.router = self.router
        try:
            for sl in self.order:
                inputs = None if sl.index == 0 else self._await(sl.micro_batch, sl.index - 1)
                if sl.micro_batch in self.finished:  # every sequence ended: its later slices cost nothing
                    continue
                self._perform(sl, inputs)
        finally:
            ex.router = saved

    def _await(self, group: int, index: int) -> dict | None:
        """The residual and every memory agent's output of ``group``'s slice ``index`` (None once
        ``group`` finished: every sequence hit EOS, said by the replica that sampled it)."""
        from agents.transport import RunAborted

        key = (group, index)
        deadline = time.monotonic() + ATTEND_TIMEOUT_S
        while not self._complete(key):
            if group in self.finished:
                return None
            if self.stop.is_set():
                raise RunAborted()
            if time.monotonic() > deadline:
                got = self._inbox.get(key, {})
                missing = [s.device for s in self.services if s.device not in got.get("out", {})]
                who = [f"memory agent {', '.join(missing)}"] if missing else []
                if "residual" not in got:
                    who.append(f"the replica of slice {index}")
                raise MemorySideSilent(f"{' and '.join(who)} did not answer slice {index} of micro-batch {group} "
                                       f"within {ATTEND_TIMEOUT_S:g} s (is it up, its link working?)")
            received = self.agent.receive_data(1 << 30)
            if received is None:
                self._check_memory_agents(group, index)
                continue
            header, bufs, _ = received
            try:
                self.take(header, bufs)
            except StageInputError as err:
                self.agent.log(f"dropped {header.kind} frame from {header.sender!r}: {err}")
        return self._inbox.pop(key)

    def _check_memory_agents(self, group: int, index: int) -> None:
        """Fail now when a memory agent this replica sends to lost its data connection (it died)."""
        memory = {s.device for s in self.services}
        down = [d for d in self._senders.silent(PEER_DOWN_S) if d in memory]
        if down:
            raise lost_connection(down, f"slice {index} of micro-batch {group}")

    def _complete(self, key) -> bool:
        got = self._inbox.get(key)
        return got is not None and "residual" in got and len(got.get("out", {})) == len(self.services)

    def take(self, header, bufs) -> None:
        """File an ``attended`` or ``residual`` frame of this run under its (batch, slice)."""
        from agents.transport import tensor_from_frame

        if header.run_id != self.run.run_id or header.kind not in ("attended", "residual", "tokens"):
            raise StageInputError(f"not a frame of staggered run {self.run.run_id}")
        if header.kind == "tokens":
            self._take_finished(header, bufs)
            return
        a = options_of(header.options)
        if not (0 <= header.micro_batch < self.n and 0 <= a.layer < self.layers and 0 <= header.step < self.run.steps):
            raise StageInputError(f"slice of micro-batch {header.micro_batch}, step {header.step}, layer {a.layer} "
                                  "is outside this run")
        key = (header.micro_batch, header.step * self.layers + a.layer)
        entry = self._inbox.setdefault(key, {})
        tensors = [tensor_from_frame(s, b) for s, b in zip(header.tensors, bufs)]
        if header.kind == "residual":
            if len(tensors) != 2 or tensors[1].dtype != torch.int64:
                raise StageInputError("a residual frame holds the hidden states and the tokens so far (int64)")
            entry["residual"] = (tensors[0], tensors[1])
        else:
            if header.sender not in {s.device for s in self.services} or len(tensors) != 1:
                raise StageInputError("attention outputs come from this run's memory agents, one tensor each")
            entry.setdefault("out", {})[header.sender] = tensors[0]

    def _take_finished(self, header, bufs) -> None:
        """A ``tokens`` frame from another replica: micro-batch ``header.micro_batch`` finished at
        ``header.step`` (every sequence hit EOS); its tokens so far [B, step + 1]."""
        from agents.transport import tensor_from_frame

        b = header.micro_batch
        if header.sender not in {p.device for p in self.replicas} or not 0 <= b < self.n \
                or len(header.tensors) != 1:
            raise StageInputError("a finished batch's tokens come from a replica of this run, one tensor")
        tokens = tensor_from_frame(header.tensors[0], bufs[0])
        if tokens.dtype != torch.int64 or tuple(tokens.shape) != (len(self.run.micro_batches[b]), header.step + 1) \
                or not bool(self._finished(tokens).all()):
            raise StageInputError(f"micro-batch {b}'s finishing tokens must be int64 [{len(self.run.micro_batches[b])}, "
                                  f"{header.step + 1}] with an EOS in every row")
        self._finish(b, tokens.clone())

    def _finish(self, group: int, tokens: torch.Tensor) -> None:
        self.finished[group] = tokens
        if self.me == 0:
            self.tokens[group] = tokens
        for key in [k for k in self._inbox if k[0] == group]:
            del self._inbox[key]

    def _announce_finished(self, group: int, step: int, tokens: torch.Tensor) -> None:
        """Every sequence of ``group`` hit EOS at ``step``: tell the other replicas (replica 0 reports
        the tokens), so nobody performs or awaits its later slices and the memory agents get none."""
        from agents.protocol import DataHeader
        from agents.transport import data_message, tensor_frame

        self._finish(group, tokens)
        spec, buf = tensor_frame(tokens.contiguous())
        for peer in self.replicas:
            if peer.device == self.agent.device:
                continue
            header = DataHeader(run_id=self.run.run_id, kind="tokens", phase="decode", step=step, micro_batch=group,
                                sender=self.agent.device, tensors=(spec,), t_sent=self.agent.clock())
            frames = data_message(header, [buf])
            self._send(peer, frames, spec.nbytes() + len(frames[0]), step, group)

    # ------------------------------------------------------------------ one slice
    def _step_inputs(self, group: int, step: int) -> _StepInputs:
        key = (group, step)
        got = self._steps.get(key)
        if got is not None:
            return got
        for old in [k for k in self._steps if k[0] == group and k[1] < step - 1]:
            del self._steps[old]
        ex, rows = self.ex, list(self.run.micro_batches[group])
        prompt = self.run.attention_mask[rows]
        mask = torch.cat([prompt, prompt.new_ones((len(rows), step))], dim=1)
        new = prompt.shape[1] if step == 0 else 1
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -new:]
        from transformers.cache_utils import Cache

        cache = Cache(layers=[_lengths_only_layer_class()() for _ in range(self.layers)])
        past = mask.shape[1] - new
        for layer in cache.layers:
            layer.length = past
        from agents.shard import _GroupState

        probe = torch.zeros((len(rows), new, ex.hidden_size), dtype=ex.dtype)
        masks, extra = ex._layer_inputs(_GroupState(cache=cache, mask=mask), probe, positions)
        got = self._steps[key] = _StepInputs(past=past, positions=positions, masks=masks, extra=extra, cache=cache)
        return got

    def _layer(self, index: int, hidden: torch.Tensor, inputs: _StepInputs) -> torch.Tensor:
        ex = self.ex
        inputs.cache.layers[index].length = inputs.past
        return ex._run_layer(ex._layers[index], hidden, inputs.masks[ex._layer_types[index]], inputs.positions,
                             inputs.cache, inputs.extra)

    def _perform(self, sl, inputs: dict | None) -> None:
        agent, ex, run = self.agent, self.ex, self.run
        b, k, L = sl.micro_batch, sl.index, self.layers
        rows = list(run.micro_batches[b])
        done = None  # the step at which every sequence of b hit EOS (in this slice)
        t0, began = agent.clock(), compute_began()
        with torch.inference_mode():
            if k == 0:
                tokens = torch.zeros((len(rows), 0), dtype=torch.int64)
                hidden = ex._embed_tokens(run.input_ids[rows], self._step_inputs(b, 0).positions)
            else:
                ps, pl = divmod(k - 1, L)
                hidden, tokens = inputs["residual"]
                out = torch.cat([inputs["out"][s.device] for s in self.services], dim=2)
                attention = getattr(ex._layers[pl], "self_attn", None) or getattr(ex._layers[pl], "attn")
                self.router.resume_with = out
                with _projections_skipped(attention):
                    hidden = self._layer(pl, hidden.to(ex.dtype), self._step_inputs(b, ps))
                self.router.resume_with = None
                if pl == L - 1:  # step ps is done: its head and sampling
                    from agents.sampling import step_generator

                    drawn = self._sample(ex._logits(hidden), step_generator(run.sampling.seed, b, ps)).to(torch.int64)
                    self._report(b, ps, drawn)
                    tokens = torch.cat([tokens, drawn[:, None]], dim=1)
                    if sl.is_tail:
                        self.tokens[b] = tokens
                    elif bool(self._finished(tokens).all()):
                        done = ps
                    else:
                        fed = torch.where(self._finished(tokens[:, :-1]), torch.full_like(drawn, run.pad), drawn)
                        hidden = ex._embed_tokens(fed[:, None], self._step_inputs(b, sl.step).positions)
            if not sl.is_tail and done is None:
                inputs_now = self._step_inputs(b, sl.step)
                try:
                    self._layer(sl.layer, hidden, inputs_now)
                except _Suspended:
                    pass
                else:
                    raise StageInputError(f"block {sl.layer} returned without calling its attention")
        end_emulated(agent.emulation.compute_slowdown, began)  # the slice is one computation: its waits came before
        _clock_event(agent, "compute", sl.step if done is None else done, b, t0, agent.clock())
        if done is not None:
            self._announce_finished(b, done, tokens)
        elif not sl.is_tail:
            self._dispatch(sl, hidden, tokens)

    def _finished(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per row: an EOS among the tokens before (the pipeline then feeds pad)."""
        if tokens.shape[1] == 0 or not self.run.eos:
            return torch.zeros(tokens.shape[0], dtype=torch.bool)
        return torch.isin(tokens, torch.tensor(sorted(self.run.eos), dtype=torch.int64)).any(dim=1)

    def _report(self, group: int, step: int, drawn: torch.Tensor) -> None:
        from agents.protocol import TokensProduced

        self.agent.post(TokensProduced(run_id=self.run.run_id, micro_batch=group, step=step,
                                        sequence_ids=tuple(self.run.micro_batches[group]),
                                        token_ids=tuple(int(t) for t in drawn.tolist()), t=self.agent.clock()),
                         wake=False)

    def _dispatch(self, sl, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """The slice's q, k, v to the memory agents, its residual to the next slice's replica."""
        from agents.protocol import DataHeader
        from agents.transport import data_message, tensor_frame

        agent, b, step = self.agent, sl.micro_batch, sl.step
        layer, query, key, value, mask, scaling = self.router.captured
        self.router.captured = None
        nxt = self.replicas[slice_replica(self.schedule, len(self.replicas), self.n, self.run.steps, self.layers,
                                          b, sl.index + 1)]
        previous = None
        if sl.index > 0:
            ps = (sl.index - 1) // self.layers
            prev_inputs = self._step_inputs(b, ps)
            previous = prev_inputs.masks[self.ex._layer_types[(sl.index - 1) % self.layers]]
        mode = mask_mode(previous, mask)
        g = self.shape.group
        phase = sl.phase
        for side in self.services:
            specs, bufs = side_frames(side, g, query, key, value, mask, mode)
            header = DataHeader(run_id=self.run.run_id, kind="attend", phase=phase, step=step, micro_batch=b,
                                sender=agent.device, tensors=tuple(specs), t_sent=agent.clock(),
                                options=options_slot(AttendSpec(layer=layer, kv_start=side.start, kv_stop=side.stop,
                                                  scaling=float(scaling), mask=mode, reply_to=nxt.device)))
            frames = data_message(header, list(bufs))
            self._send(side, frames, sum(s.nbytes() for s in specs) + len(frames[0]), step, b)
        residual = hidden.detach().to(torch.float32).contiguous()
        if nxt.device == agent.device:
            self._inbox.setdefault((b, sl.index), {})["residual"] = (residual, tokens)
            return
        specs, bufs = zip(*(tensor_frame(t) for t in (residual, tokens.contiguous())))
        header = DataHeader(run_id=self.run.run_id, kind="residual", phase=phase, step=step, micro_batch=b,
                            sender=agent.device, tensors=tuple(specs), t_sent=agent.clock(),
                            options=options_slot(AttendSpec(layer=layer, kv_start=0, kv_stop=self.shape.kv_heads)))
        frames = data_message(header, list(bufs))
        self._send(nxt, frames, sum(s.nbytes() for s in specs) + len(frames[0]), step, b)

    def final_tokens(self) -> tuple[tuple[int, ...], ...]:
        """Replica 0 after its slices: per sequence, the tokens up to and including its first EOS."""
        out: dict[int, tuple[int, ...]] = {}
        for b, rows in enumerate(self.run.micro_batches):
            for i, seq in enumerate(rows):
                got = []
                for t in self.tokens[b][i].tolist():
                    got.append(int(t))
                    if t in self.run.eos:
                        break
                out[seq] = tuple(got)
        return tuple(out.get(i, ()) for i in range(len(self.run.input_ids)))


def run_inputs(run_id: str, msg) -> RunInputs:
    """``RunInputs`` of a ``StartRun`` (replica 0) or a ``HoldDense``."""
    return RunInputs(run_id=run_id, micro_batches=tuple(tuple(g) for g in msg.micro_batches),
                     input_ids=torch.tensor(msg.input_ids, dtype=torch.int64),
                     attention_mask=torch.tensor(msg.attention_mask, dtype=torch.int64), steps=msg.max_new_tokens,
                     eos=frozenset(msg.eos_token_ids), pad=msg.pad_token_id, sampling=msg.sampling)


def run_source(agent, loaded, msg, stop) -> tuple[tuple[int, ...], ...]:
    """Replica 0 (the run's source stage, ``StartRun.options``: a ``StaggeredSpec``): start the others, perform its
    slices (every tail among them), return the run's tokens."""
    executor = getattr(loaded.executor, "_executor", loaded.executor)  # an emulation wrapper's own
    if not isinstance(executor, DenseExecutor):
        raise StageInputError("a staggered run needs an attention-offload-dense stage loaded")
    spec = options_of(msg.options)
    services = options_of(loaded.msg.options).services
    if not spec.replicas or spec.replicas[0].device != agent.device:
        raise StageInputError(f"replica 0 of a staggered run is its source, {agent.device}")
    agent.gate_data([s.public_key for s in services] + [p.public_key for p in spec.replicas[1:]])
    replica = StaggeredReplica(agent, executor, me=0, schedule=spec.schedule, replicas=spec.replicas,
                               services=services, run=run_inputs(msg.run_id, msg), stop=stop,
                               link=loaded.link)
    try:
        replica.start_others()
        replica.perform()
        return replica.final_tokens()
    finally:
        replica.close()


class HeldReplica:
    """A compute replica other than 0 (``HoldDense``): loads the dense part, waits for the source's
    ``start`` frame, performs its slices, then serves until the hold is stopped."""

    def __init__(self, agent, msg, stop):
        self.agent, self.msg, self.stop = agent, msg, stop
        self.executor = DenseExecutor(msg.model_dir, 0, _units(msg.model_dir),
                                      sides=[_Covers(range(s.start, s.stop)) for s in msg.services],
                                      dtype=msg.dtype, threads=msg.threads or None)
        agent.emulation.check_shard(agent.device, int(self.executor.memory_bytes()), (0, self.executor.num_units))
        agent.gate_data([s.public_key for s in msg.services]
                        + [p.public_key for i, p in enumerate(msg.staggered.replicas) if i != msg.replica])
        self.replica: StaggeredReplica | None = None

    def close(self) -> None:
        if self.replica is not None:
            self.replica.close()

    def serve(self) -> None:
        from agents.transport import RunAborted

        agent, msg = self.agent, self.msg
        early = []
        while self.replica is None:
            if self.stop.is_set():
                raise RunAborted()
            received = agent.receive_data(1 << 30)
            if received is None:
                continue
            header, bufs, _ = received
            if header.kind == "start" and header.sender == msg.staggered.replicas[0].device:
                agent.set_event_meta(header.run_id, 0)
                self.replica = StaggeredReplica(agent, self.executor, me=msg.replica,
                                                schedule=msg.staggered.schedule, replicas=msg.staggered.replicas,
                                                services=msg.services, run=run_inputs(header.run_id, msg),
                                                stop=self.stop, link=msg.link if msg.link.bandwidth_mbit_s
                                                or msg.link.latency_ms else None)
            else:  # a memory agent's answer may overtake the start: kept (copied out of the frame)
                early.append((header, [memoryview(bytearray(b)) for b in bufs]))
        try:
            for header, bufs in early:
                try:
                    self.replica.take(header, bufs)
                except StageInputError as err:
                    agent.log(f"dropped {header.kind} frame from {header.sender!r}: {err}")
            self.replica.perform()
        except Exception as err:  # the run's own id: the coordinator ends the run naming this replica
            if not isinstance(err, RunAborted):
                from agents.protocol import RunError

                agent.post(RunError(run_id=self.replica.run.run_id, device=agent.device,
                                     message=f"{type(err).__name__}: {err}"))
            raise
        while not self.stop.is_set():
            time.sleep(0.02)
        raise RunAborted()


def _units(model_dir: str) -> int:
    return HeadShape.of(model_dir).layers + 2
