"""Encode / prefill / decode disaggregation (EPD), the agent side: one executor per phase.

A Llava checkpoint (CLIP vision tower + projector + Llama text model) is split by *phase*,
not by layer: an **encode** agent holds only the vision tower and projector and turns image
tiles into multimodal tokens; a **prefill** agent holds the text model, scatters those tokens
into the prompt's embeddings at its ``<image>`` positions, builds the KV cache and picks the
first token; a **decode** agent holds the text model too, receives that KV cache and
generates the rest. Each executor reads only its own tensors from the checkpoint.

Requests and replies are control messages (``EncodeTiles``/``TilesEncoded``,
``PrefillPrompt``/``PromptPrefilled``, ``DecodeTokens``/``TokensDecoded`` in
agents.protocol) with tensors as raw little-endian float32 bytes beside their shapes, never
pickled. Sampling draws from a ``torch.Generator`` seeded once per request whose state
travels with the KV cache (raw bytes), so prefill's first draw and decode's next draws are
the single-process sequence. Stage kinds: ``epd-encode``, ``epd-prefill``, ``epd-decode``.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from agents.checkpoint_reader import CheckpointError, CheckpointReader, torch_dtype
from agents.phase_kinds import KINDS
from agents.protocol import (
    MAX_RNG_STATE,
    DecodeTokens,
    EncodeTiles,
    PrefillPrompt,
    PromptPrefilled,
    TilesEncoded,
    TokensDecoded,
)
from agents.sampling import SamplingParams, sample


class PhaseRequestError(ValueError):
    """A phase request this executor cannot serve (wrong shapes, wrong phase): named in the reply."""


def llava_config(model_dir: str | Path):
    """The checkpoint's ``LlavaConfig`` (sdpa attention), or ``CheckpointError`` saying why not."""
    from transformers import LlavaConfig

    path = Path(model_dir)
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}/config.json: cannot be read: {err}") from None
    if not isinstance(data, dict) or data.get("model_type") != "llava":
        raise CheckpointError(f"{path}: not a Llava checkpoint (phase disaggregation runs Llava models)")
    config = LlavaConfig.from_pretrained(str(path), local_files_only=True)
    if config.text_config.model_type != "llama" or config.vision_config.model_type != "clip_vision_model":
        raise CheckpointError(f"{path}: needs a CLIP vision tower and a Llama text model")
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "sdpa"
    return config


def _load(module, reader: CheckpointReader, prefix: str, dtype) -> None:
    """Fill ``module`` from the checkpoint's tensors under ``prefix`` (every one must be there)."""
    own = module.state_dict()
    names = {prefix + k: k for k in own}
    tensors = reader.read(sorted(names), dtype)
    module.load_state_dict({names[n]: t for n, t in tensors.items()}, strict=True)


VISION_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                   "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
HEAD_PREFIXES = ("language_model.lm_head.", "lm_head.")
"""Where Llava checkpoints keep each part: transformers 5 saves the first layout of each (the
hub's Llava-1.5 files too); the ``model.*`` ones are the in-memory names some tools save."""


def _prefix(reader: CheckpointReader, prefixes: tuple[str, ...], probe: str) -> str:
    for p in prefixes:
        if p + probe in reader:
            return p
    raise CheckpointError(f"{reader.model_dir}: no {probe!r} under any of {', '.join(prefixes)}")


class _PhaseExecutor:
    """What the shared stage loop would call: a phase executor is driven by phase requests instead."""

    is_first = True
    is_last = True
    phase = ""

    def prefill(self, group, x, attention_mask):
        raise PhaseRequestError(f"a {KINDS[self.phase]} stage runs phase requests, not the layer pipeline")

    decode = prefill

    def drop(self, group: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self._modules() for p in m.parameters())

    def _modules(self):
        return ()

    def serve(self, msg, clock=time.time, slowdown: float = 1.0, links: PhaseLinks | None = None):
        raise NotImplementedError


class EncodeExecutor(_PhaseExecutor):
    """The vision tower and projector only: tiles in, multimodal tokens out."""

    phase = "encode"

    def __init__(self, model_dir: str, start: int = 0, end: int = 1, *, dtype: str = "float32",
                 threads: int | None = None, progress=None) -> None:
        from transformers import CLIPVisionModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.config = config = llava_config(model_dir)
        self.dtype = torch_dtype(dtype)
        reader = CheckpointReader(model_dir)
        self.tower = CLIPVisionModel(config.vision_config)  # built on the CPU: non-persistent buffers initialised
        self.projector = LlavaMultiModalProjector(config)
        _load(self.tower, reader, _prefix(reader, VISION_PREFIXES, "embeddings.patch_embedding.weight"),
              self.dtype)
        _load(self.projector, reader, _prefix(reader, PROJECTOR_PREFIXES, "linear_1.weight"), self.dtype)
        self.tower.eval()
        self.projector.eval()
        self.layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.tile = config.vision_config.image_size
        if progress:
            progress(1.0)

    def _modules(self):
        return (self.tower, self.projector)

    @torch.inference_mode()
    def encode(self, tiles: torch.Tensor) -> torch.Tensor:
        """N×3×T×T tiles → N×S×H multimodal tokens (Llava's ``get_image_features``, per tile)."""
        if tiles.dim() != 4 or tuple(tiles.shape[1:]) != (3, self.tile, self.tile):
            raise PhaseRequestError(f"tiles must be N×3×{self.tile}×{self.tile}, got {list(tiles.shape)}")
        out = self.tower(tiles.to(self.dtype), output_hidden_states=True, return_dict=True)
        h = out.hidden_states[self.layer]
        if self.strategy == "default":
            h = h[:, 1:]
        return self.projector(h).float()

    def serve(self, msg: EncodeTiles, clock=time.time, slowdown: float = 1.0,
              links: PhaseLinks | None = None) -> TilesEncoded:
        if not isinstance(msg, EncodeTiles):
            raise PhaseRequestError(f"an encode agent serves encode_tiles, not {msg.type_name()}")
        t_start = clock()
        with emulated(slowdown):
            out = self.encode(from_bytes(msg.shape, msg.data))
        t_end = clock()
        if msg.send_to:
            _links(links).send(msg.send_to, "mm", msg.request, msg.piece, out)
            return TilesEncoded(req=msg.req, request=msg.request, tiles=msg.tiles, shape=tuple(out.shape), data=b"",
                                t_start=t_start, t_end=t_end, sent_to=msg.send_to, t_sent=clock())
        return TilesEncoded(req=msg.req, request=msg.request, tiles=msg.tiles, shape=tuple(out.shape),
                            data=to_bytes(out), t_start=t_start, t_end=t_end)


class _TextExecutor(_PhaseExecutor):
    """The Llama text model (embeddings, blocks, norm, head) of a Llava checkpoint."""

    def __init__(self, model_dir: str, start: int = 0, end: int = 1, *, dtype: str = "float32",
                 threads: int | None = None, progress=None) -> None:
        from transformers import LlamaForCausalLM

        self.config = config = llava_config(model_dir)
        self.dtype = torch_dtype(dtype)
        reader = CheckpointReader(model_dir)
        self.lm = LlamaForCausalLM(config.text_config)
        _load(self.lm.model, reader, _prefix(reader, TEXT_PREFIXES, "embed_tokens.weight"), self.dtype)
        _load(self.lm.lm_head, reader, _prefix(reader, HEAD_PREFIXES, "weight"), self.dtype)
        self.lm.eval()
        self.image_token_id = int(config.image_token_id)
        tc = config.text_config
        self.kv_heads = int(tc.num_key_value_heads)
        self.head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self.layers = int(tc.num_hidden_layers)
        self.vocab = int(tc.vocab_size)
        if progress:
            progress(1.0)

    def _modules(self):
        return (self.lm,)


class PrefillExecutor(_TextExecutor):
    """Prompt + multimodal tokens → KV cache and the first token."""

    phase = "prefill"

    @torch.inference_mode()
    def prefill_prompt(self, input_ids: list[int], mm: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator) -> tuple[int, torch.Tensor]:
        """The first token and the KV cache as one tensor [layers, 2, kv_heads, L, head_dim]."""
        from transformers import DynamicCache

        ids = torch.tensor([input_ids], dtype=torch.long)
        if int(ids.max()) >= self.vocab or int(ids.min()) < 0:
            raise PhaseRequestError(f"token ids must be in [0, {self.vocab})")
        slots = ids == self.image_token_id
        n_image = int(slots.sum())
        if mm.dim() != 2 or mm.shape[0] != n_image or mm.shape[1] != self.lm.config.hidden_size:
            raise PhaseRequestError(f"the prompt has {n_image} <image> tokens of width {self.lm.config.hidden_size}; "
                                    f"got multimodal tokens {list(mm.shape)}")
        embeds = self.lm.get_input_embeddings()(ids)
        embeds = embeds.masked_scatter(slots.unsqueeze(-1), mm.to(embeds.dtype))
        cache = DynamicCache(config=self.lm.config)
        out = self.lm(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), cache=cache,
                      use_cache=True, logits_to_keep=1)
        token = int(sample(out.logits[:, -1], params, generator)[0])
        kv = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
        return token, kv

    def serve(self, msg: PrefillPrompt, clock=time.time, slowdown: float = 1.0,
              links: PhaseLinks | None = None) -> PromptPrefilled:
        if not isinstance(msg, PrefillPrompt):
            raise PhaseRequestError(f"a prefill agent serves prefill_prompt, not {msg.type_name()}")
        received = 0.0
        if msg.mm_pieces:  # the encoders' tokens, from this agent's store of what arrived
            got = _links(links).take("mm", msg.request, msg.mm_pieces)
            received = max(t for _, t in got.values())
            mm = torch.cat([got[p][0].reshape(-1, got[p][0].shape[-1]) for p in msg.mm_pieces])
            if tuple(mm.shape) != tuple(msg.mm_shape):
                raise PhaseRequestError(f"the pieces hold multimodal tokens {list(mm.shape)}, the request says "
                                        f"{list(msg.mm_shape)}")
        else:
            mm = from_bytes(msg.mm_shape, msg.mm) if msg.mm_shape else torch.empty(0, self.lm.config.hidden_size)
        t_start = clock()
        params = sampling_params(msg.sampling, 1)
        generator = params.make_generator()
        with emulated(slowdown):
            token, kv = self.prefill_prompt(list(msg.input_ids), mm, params, generator)
        t_end = clock()
        rng = generator.get_state().numpy().tobytes()
        if msg.send_to:  # the KV cache, then what decode goes on from: it can start as soon as both are there
            _links(links).send(msg.send_to, "kv", msg.request, 0, kv.reshape(-1, *kv.shape[2:]))
            _links(links).send(msg.send_to, "kv", msg.request, HANDOFF_PIECE, handoff_tensor(token, rng))
            return PromptPrefilled(req=msg.req, request=msg.request, token=token, kv_shape=tuple(kv.shape), kv=b"",
                                   rng=rng, t_start=t_start, t_end=t_end, mm_received=received, sent_to=msg.send_to)
        return PromptPrefilled(req=msg.req, request=msg.request, token=token, kv_shape=tuple(kv.shape),
                               kv=to_bytes(kv), rng=rng, t_start=t_start, t_end=t_end, mm_received=received)


class DecodeExecutor(_TextExecutor):
    """KV cache + first token → the remaining tokens, one step at a time."""

    phase = "decode"

    @torch.inference_mode()
    def decode_tokens(self, kv: torch.Tensor, first: int, max_new_tokens: int, params: SamplingParams,
                      generator: torch.Generator, eos: tuple[int, ...] = (), copies: int = 1,
                      clock=time.time, slowdown: float = 1.0) -> tuple[list[int], list[float]]:
        """Tokens after ``first`` (at most ``max_new_tokens - 1``, stopping after an eos) and the
        clock time each step ended. ``copies`` > 1 decodes that many copies of the sequence as one
        batch (profiling a decode batch on real shapes); row 0's tokens are returned."""
        from transformers import DynamicCache

        expect = (self.layers, 2, self.kv_heads, kv.shape[3] if kv.dim() == 5 else 0, self.head_dim)
        if kv.dim() != 5 or tuple(kv.shape) != expect or kv.shape[3] < 1:
            raise PhaseRequestError(f"KV cache must be {list(expect)} (layers, k/v, kv heads, tokens, head dim), "
                                    f"got {list(kv.shape)}")
        if not 0 <= first < self.vocab:
            raise PhaseRequestError(f"first token must be in [0, {self.vocab})")
        cache = DynamicCache(config=self.lm.config)
        for i in range(self.layers):
            k = kv[i, 0].unsqueeze(0).expand(copies, -1, -1, -1).to(self.dtype).contiguous()
            v = kv[i, 1].unsqueeze(0).expand(copies, -1, -1, -1).to(self.dtype).contiguous()
            cache.update(k, v, i)
        context = kv.shape[3]
        tokens, ends = [], []
        token = first
        while len(tokens) + 1 < max_new_tokens and token not in eos:
            ids = torch.full((copies, 1), token, dtype=torch.long)
            mask = torch.ones(copies, context + len(tokens) + 1, dtype=torch.long)
            with emulated(slowdown):
                out = self.lm(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
                token = int(sample(out.logits[:, -1], params, generator)[0])
            tokens.append(token)
            ends.append(clock())
        return tokens, ends

    def serve(self, msg: DecodeTokens, clock=time.time, slowdown: float = 1.0,
              links: PhaseLinks | None = None) -> TokensDecoded:
        if not isinstance(msg, DecodeTokens):
            raise PhaseRequestError(f"a decode agent serves decode_tokens, not {msg.type_name()}")
        received, first, rng = 0.0, msg.first_token, msg.rng
        if msg.kv_from:  # the KV cache and the first token + sampler state, pushed by the prefill agent
            got = _links(links).take("kv", msg.request, (0, HANDOFF_PIECE))
            received = max(t for _, t in got.values())
            kv = got[0][0]
            if kv.numel() != int(np.prod(msg.kv_shape)):
                raise PhaseRequestError(f"the KV cache that arrived holds {kv.numel()} values, not {list(msg.kv_shape)}")
            kv = kv.reshape(msg.kv_shape)
            first, rng = from_handoff(got[HANDOFF_PIECE][0])
        else:
            kv = from_bytes(msg.kv_shape, msg.kv)
        t_start = clock()
        params = sampling_params(msg.sampling, msg.max_new_tokens)
        generator = params.make_generator()
        if rng:
            try:
                generator.set_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
            except (RuntimeError, ValueError) as err:
                raise PhaseRequestError(f"rng state not usable here ({err})") from None
        tokens, ends = self.decode_tokens(kv, first, msg.max_new_tokens,
                                          params, generator, tuple(msg.eos_token_ids), msg.copies, clock, slowdown)
        return TokensDecoded(req=msg.req, request=msg.request, tokens=tuple(tokens), step_ends=tuple(ends),
                             t_start=t_start, t_end=clock(), kv_received=received)


@contextlib.contextmanager
def emulated(slowdown: float):
    """Make the block last ``slowdown`` times the CPU time it used (an emulated slower device),
    per step, so step times and spans stay consistent. CPU time, not wall time: on a shared
    machine, time spent waiting for a core would otherwise be multiplied too, and the device
    would seem slower the busier its neighbours are. (The calling thread's CPU time: agents run
    phases with one torch thread.)"""
    w0, c0 = time.perf_counter(), time.thread_time()
    yield
    if slowdown > 1.0:
        time.sleep(max(0.0, slowdown * (time.thread_time() - c0) - (time.perf_counter() - w0)))


MAX_HELD_BYTES = 512 << 20
"""What a phase agent keeps of tensors that arrived before their request (its side of the
multimodal / KV cache); the coordinator reserves room before sending, so more is a peer's error."""
TAKE_TIMEOUT_S = 60.0
HANDOFF_PIECE = 1
"""The ``kv`` piece beside the KV cache (piece 0): the first token and the sampler state, so a
decode agent starts when they arrive, not when the coordinator hears from the prefill agent."""


def handoff_tensor(token: int, rng: bytes) -> torch.Tensor:
    """The first token and the sampler state's bytes as one float32 vector (exact: all < 2**24)."""
    if not 0 <= token < 1 << 24:
        raise PhaseRequestError(f"a token id {token} does not travel as a float32 handoff (below 2**24 only)")
    return torch.tensor([token, *rng], dtype=torch.float32)


def from_handoff(t: torch.Tensor) -> tuple[int, bytes]:
    """``handoff_tensor``'s inverse; ``PhaseRequestError`` for a vector that is not one."""
    v = t.reshape(-1)
    if v.numel() < 1 or v.numel() > 1 + MAX_RNG_STATE or not torch.equal(v, v.round()) \
            or float(v.min()) < 0 or float(v[0]) >= 1 << 24 or (v.numel() > 1 and float(v[1:].max()) > 255):
        raise PhaseRequestError("the prefill agent's handoff is not a token and sampler-state bytes")
    return int(v[0]), bytes(v[1:].to(torch.uint8).tolist())


class PhaseLinks:
    """An agent's EPD data plane: pushes tensors to its pool peers' data sockets (Curve, raw frames
    beside a checked header, through the emulated link) and keeps what arrives for its requests in
    a bounded store until a request takes it. One per loaded phase stage."""

    def __init__(self, agent, peers) -> None:
        self.agent = agent
        self.peers = {p.device: p for p in peers}
        self.held: dict[tuple[str, int, int], tuple[torch.Tensor, float]] = {}
        self.held_bytes = 0
        from agents.transport import PeerSenders

        self._senders = PeerSenders(agent.context, agent.keys, 1000, clock=agent.clock)

    def close(self) -> None:
        self._senders.close()

    def send(self, device: str, kind: str, request: int, piece: int, x: torch.Tensor) -> None:
        from agents.protocol import DataHeader
        from agents.transport import data_message, tensor_frame

        if device not in self.peers or device == self.agent.device:
            raise PhaseRequestError(f"{device!r} is not a peer of this stage's pools")
        sender = self._senders.to(device, self.peers[device], self.agent.default_link)
        spec, buf = tensor_frame(x.float().contiguous())
        header = DataHeader(run_id="epd", kind=kind, phase="prefill", step=request, micro_batch=piece,
                            sender=self.agent.device, tensors=(spec,), t_sent=self.agent.clock())
        sender.send(data_message(header, [buf]), spec.nbytes())

    def take(self, kind: str, request: int, pieces, timeout_s: float = TAKE_TIMEOUT_S) -> dict:
        """The pieces of ``request`` (tensor, arrival time on this agent's clock), receiving until all
        are here; ``PhaseRequestError`` naming what is missing after ``timeout_s``."""
        import zmq

        from agents.protocol import ProtocolError, decode_data
        from agents.transport import tensor_from_frame

        want = {(kind, request, p) for p in pieces}
        deadline = time.monotonic() + timeout_s
        while not want <= self.held.keys():
            if time.monotonic() > deadline:
                missing = sorted(p for k, r, p in want - self.held.keys())
                raise PhaseRequestError(f"{kind} pieces {missing} of request {request} did not arrive within "
                                        f"{timeout_s:g} s (is the sending agent up and its link working?)")
            try:
                frames = self.agent._data.recv_multipart(copy=False)
            except zmq.Again:
                continue
            got = self.agent.clock()
            try:
                header, bufs = decode_data(frames, MAX_HELD_BYTES)
            except ProtocolError as err:
                self.agent._log(f"dropped data message: {err.code}: {err}")
                continue
            key = (header.kind, header.step, header.micro_batch)
            if header.run_id != "epd" or header.kind not in ("mm", "kv") or header.sender not in self.peers \
                    or len(header.tensors) != 1 or header.tensors[0].dtype != "float32" or key in self.held:
                self.agent._log(f"dropped a data message from {header.sender!r}: not an expected EPD piece")
                continue
            nbytes = header.tensors[0].nbytes()
            if self.held_bytes + nbytes > MAX_HELD_BYTES:
                self.agent._log(f"dropped {header.kind} piece of request {header.step}: the store is full")
                continue
            self.held[key] = (tensor_from_frame(header.tensors[0], bufs[0]).clone(), got)
            self.held_bytes += nbytes
        out = {}
        for key in sorted(want):
            t, when = self.held.pop(key)
            self.held_bytes -= t.numel() * 4
            out[key[2]] = (t, when)
        return out


def _links(links: PhaseLinks | None) -> PhaseLinks:
    if links is None:
        raise PhaseRequestError("this request moves tensors over the data plane, which only an agent has")
    return links


def sampling_params(spec, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                          max_new_tokens=max(1, max_new_tokens))


def to_bytes(t: torch.Tensor) -> bytes:
    """A tensor as raw little-endian float32 bytes (what travels; its shape travels beside it)."""
    return t.detach().contiguous().float().numpy().astype("<f4", copy=False).tobytes()


def from_bytes(shape, data: bytes) -> torch.Tensor:
    """Raw float32 bytes back as a tensor of ``shape`` (sizes were checked at decode)."""
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(tuple(shape)).copy())


def encode_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None):
    return EncodeExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress)


def prefill_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None):
    return PrefillExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress)


def decode_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None):
    return DecodeExecutor(model_dir, start, end, dtype=dtype, threads=threads, progress=progress)
