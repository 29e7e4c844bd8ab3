"""Encode / prefill / decode disaggregation (EPD), the agent side: one executor per phase.

A Llava checkpoint (CLIP vision tower + projector + Llama text model) is split by *phase*,
not by layer: an **encode** agent holds only the vision tower and projector and turns image
tiles into multimodal tokens; a **prefill** agent holds the text model, scatters those tokens
into the prompt's embeddings at its ``<image>`` positions, builds the KV cache and picks the
first token; a **decode** agent holds the text model too, receives that KV cache and
generates the rest. Each executor reads only its own tensors from the checkpoint.

Requests and replies are control messages (``EncodeTiles``/``TilesEncoded``,
``PrefillPrompt``/``PromptPrefilled``, ``DecodeTokens``/``TokensDecoded`` in
this room's ``messages``) with tensors as raw little-endian float32 bytes beside their shapes, never
pickled. Sampling draws from a ``torch.Generator`` seeded once per request whose state
travels with the KV cache (raw bytes), so prefill's first draw and decode's next draws are
the single-process sequence. Stage kinds: ``epd-encode``, ``epd-prefill``, ``epd-decode``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from agents.checkpoint_reader import CheckpointError, CheckpointReader, torch_dtype
from agents.emulation import emulated
from agents.heap import blocks_returned
from agents.sampling import SamplingParams, sample
from agents.techniques.phase_disaggregation.kinds import COUPLED_KINDS, KINDS
from agents.techniques.phase_disaggregation.links import (  # noqa: F401  (PhaseRequestError: public here too)
    HANDOFF_PIECE,
    TAKE_TIMEOUT_S,
    PhaseLinks,
    PhaseRequestError,
    _links,
    from_handoff,
    handoff_tensor,
)
from agents.techniques.phase_disaggregation.messages import (
    DecodeTokens,
    EncodeTiles,
    PrefillPrompt,
    PromptPrefilled,
    TilesEncoded,
    TokensDecoded,
)


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
    """Fill ``module`` from the checkpoint's tensors under ``prefix``, one at a time: the weights held once plus one
    tensor (reading all first held them twice: 134.5 MiB for 68.5 MiB of weights, bench/memory_fidelity.py)."""
    with torch.no_grad():
        for key, target in module.state_dict().items():
            name = prefix + key
            tensor = reader.read([name], dtype)[name]
            if tensor.shape != target.shape:
                raise CheckpointError(f"{reader.model_dir}: {name} is {list(tensor.shape)} in the checkpoint, "
                                      f"{list(target.shape)} in the model its config describes")
            target.copy_(tensor)


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
        raise PhaseRequestError(f"a {KINDS.get(self.phase, self.phase)} stage runs phase requests, not the layer "
                                f"pipeline")

    def decode_batch(self, **kwargs) -> DecodeBatch | None:
        """A continuous decode batch over this executor's text model (None: it does not decode)."""
        return None

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
        with emulated(slowdown), blocks_returned():  # RSS is the live tensors (agents.heap)
            out = self.encode(from_bytes(msg.shape, msg.data))
        t_end = clock()
        if msg.send_to:
            _links(links).send(msg.send_to, "mm", msg.run, msg.request, msg.piece, out)
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
            got = _links(links).take("mm", msg.run, msg.request, msg.mm_pieces)
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
        with emulated(slowdown), blocks_returned():  # RSS is the live tensors (agents.heap)
            token, kv = self.prefill_prompt(list(msg.input_ids), mm, params, generator)
        t_end = clock()
        rng = b"" if params.greedy else generator.get_state().numpy().tobytes()  # greedy never draws from it
        if msg.send_to:  # the KV cache, then what decode goes on from: it can start as soon as both are there
            _links(links).send(msg.send_to, "kv", msg.run, msg.request, 0, kv.reshape(-1, *kv.shape[2:]))
            _links(links).send(msg.send_to, "kv", msg.run, msg.request, HANDOFF_PIECE, handoff_tensor(token, rng))
            return PromptPrefilled(req=msg.req, request=msg.request, token=token, kv_shape=tuple(kv.shape), kv=b"",
                                   rng=rng, t_start=t_start, t_end=t_end, mm_received=received, sent_to=msg.send_to)
        return PromptPrefilled(req=msg.req, request=msg.request, token=token, kv_shape=tuple(kv.shape),
                               kv=to_bytes(kv), rng=rng, t_start=t_start, t_end=t_end, mm_received=received)


class DecodeExecutor(_TextExecutor):
    """KV cache + first token → the remaining tokens, one step at a time."""

    phase = "decode"

    def decode_batch(self, **kwargs) -> DecodeBatch:
        return DecodeBatch(self, **kwargs)

    def check_kv(self, kv: torch.Tensor, first: int) -> None:
        """A KV cache of this model's geometry holding at least one token, and a token of its vocabulary."""
        expect = (self.layers, 2, self.kv_heads, kv.shape[3] if kv.dim() == 5 else 0, self.head_dim)
        if kv.dim() != 5 or tuple(kv.shape) != expect or kv.shape[3] < 1:
            raise PhaseRequestError(f"KV cache must be {list(expect)} (layers, k/v, kv heads, tokens, head dim), "
                                    f"got {list(kv.shape)}")
        if not 0 <= first < self.vocab:
            raise PhaseRequestError(f"first token must be in [0, {self.vocab})")

    @classmethod
    def sharing(cls, text: _TextExecutor) -> DecodeExecutor:
        """A decode executor over ``text``'s already loaded model (a coupled agent holds it once)."""
        out = cls.__new__(cls)
        out.__dict__.update(text.__dict__)
        return out

    @torch.inference_mode()
    def decode_tokens(self, kv: torch.Tensor, first: int, max_new_tokens: int, params: SamplingParams,
                      generator: torch.Generator, eos: tuple[int, ...] = (), copies: int = 1,
                      clock=time.time, slowdown: float = 1.0) -> tuple[list[int], list[float]]:
        """Tokens after ``first`` (at most ``max_new_tokens - 1``, stopping after an eos) and the
        clock time each step ended. ``copies`` > 1 decodes that many copies of the sequence as one
        batch (profiling a decode batch on real shapes); row 0's tokens are returned."""
        from transformers import DynamicCache

        self.check_kv(kv, first)
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
            got = _links(links).take("kv", msg.run, msg.request, (0, HANDOFF_PIECE))
            received = max(t for _, t in got.values())
            kv = got[0][0]
            if kv.numel() != int(np.prod(msg.kv_shape)):
                raise PhaseRequestError(f"the KV cache that arrived holds {kv.numel()} values, not {list(msg.kv_shape)}")
            kv = kv.reshape(msg.kv_shape)
            first, rng = from_handoff(got[HANDOFF_PIECE][0])
        else:
            kv = from_bytes(msg.kv_shape, msg.kv)
        t_start = clock()
        params, generator = resumed_sampler(msg, rng)
        tokens, ends = self.decode_tokens(kv, first, msg.max_new_tokens,
                                          params, generator, tuple(msg.eos_token_ids), msg.copies, clock, slowdown)
        return TokensDecoded(req=msg.req, request=msg.request, tokens=tuple(tokens), step_ends=tuple(ends),
                             t_start=t_start, t_end=clock(), kv_received=received)


MAX_DECODE_BATCH = 64
"""Sequences one decode agent runs at once; the coordinator sends at most its pools' ``decode_batch``
(and what its KV cache holds), so this only bounds a coordinator that does not."""
WAITING_POLL_MS = 5
"""How long a decode agent with nothing to step waits on its data socket for a KV cache before it
looks for new requests again."""


class _Sequence:
    """One request in a decode batch: its KV cache (per layer, while the batch is being rebuilt),
    its last token, its sampler and what it generated."""

    def __init__(self, msg: DecodeTokens, kv: torch.Tensor, first: int, params: SamplingParams,
                 generator: torch.Generator, t_start: float, received: float) -> None:
        self.msg, self.token, self.params, self.generator = msg, first, params, generator
        self.keys = [kv[i, 0].unsqueeze(0) for i in range(kv.shape[0])]
        self.values = [kv[i, 1].unsqueeze(0) for i in range(kv.shape[0])]
        self.length = kv.shape[3]
        self.tokens: list[int] = []
        self.ends: list[float] = []
        self.t_start, self.received = t_start, received
        self.eos = tuple(msg.eos_token_ids)

    def done(self) -> bool:
        return len(self.tokens) + 1 >= self.msg.max_new_tokens or self.token in self.eos


class DecodeBatch:
    """Continuous batching on a decode agent: a request joins the running batch between two steps
    as soon as its KV cache is here, and leaves it (its answer sent) when it is done, so a new
    request never waits for the others to finish. One left-padded batch cache, rebuilt only when
    the members change; each row has its own positions, mask and sampler, so its tokens are the
    ones it would generate alone. ``answer(msg, reply_or_error)`` gets each request's outcome."""

    def __init__(self, executor: DecodeExecutor, *, answer, clock=time.time, slowdown: float = 1.0,
                 links: PhaseLinks | None = None) -> None:
        self.x, self.answer, self.clock, self.slowdown, self.links = executor, answer, clock, slowdown, links
        self.running: list[_Sequence] = []
        self.waiting: list[tuple[DecodeTokens, float]] = []
        """Requests whose KV cache is on its way (data plane), with their deadline (monotonic)."""
        self.cache = None
        self.pads: list[int] = []
        self.width = 0

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, msg) -> None:
        """A decode request: it joins now (its KV cache inline) or once its KV cache arrives."""
        try:
            if not isinstance(msg, DecodeTokens):
                raise PhaseRequestError(f"a decode agent serves decode_tokens, not {msg.type_name()}")
            if msg.kv_from:
                self.waiting.append((msg, time.monotonic() + TAKE_TIMEOUT_S))
            else:
                self._join(msg, from_bytes(msg.kv_shape, msg.kv), msg.first_token, msg.rng, 0.0)
        except ValueError as err:
            self.answer(msg, err)

    def _join(self, msg: DecodeTokens, kv: torch.Tensor, first: int, rng: bytes, received: float) -> None:
        x = self.x
        x.check_kv(kv, first)
        params, generator = resumed_sampler(msg, rng)
        seq = _Sequence(msg, kv.to(x.dtype), first, params, generator, self.clock(), received)
        if seq.done():
            self._finish(seq)
            return
        self._unpack()
        self.running.append(seq)

    def _admit(self) -> None:
        """Join every waiting request whose KV cache (and first token) arrived; fail the overdue."""
        if not self.waiting or len(self.running) >= MAX_DECODE_BATCH:
            return
        links = _links(self.links)
        while links.receive(0):
            pass
        for item in list(self.waiting):
            msg, deadline = item
            if len(self.running) >= MAX_DECODE_BATCH:
                break
            pieces = (0, HANDOFF_PIECE)
            if links.has("kv", msg.run, msg.request, pieces):
                self.waiting.remove(item)
                try:
                    got = links.pop("kv", msg.run, msg.request, pieces)
                    kv = got[0][0]
                    if kv.numel() != int(np.prod(msg.kv_shape)):
                        raise PhaseRequestError(f"the KV cache that arrived holds {kv.numel()} values, not "
                                                f"{list(msg.kv_shape)}")
                    first, rng = from_handoff(got[HANDOFF_PIECE][0])
                    self._join(msg, kv.reshape(msg.kv_shape), first, rng, max(t for _, t in got.values()))
                except ValueError as err:
                    self.answer(msg, err)
            elif time.monotonic() > deadline:
                self.waiting.remove(item)
                self.answer(msg, PhaseRequestError(links.missing("kv", msg.run, msg.request, pieces, TAKE_TIMEOUT_S)))

    def _unpack(self) -> None:
        """Each running row's KV back into its sequence (before the members change)."""
        if self.cache is None:
            return
        for r, (seq, pad) in enumerate(zip(self.running, self.pads)):
            seq.keys = [layer.keys[r:r + 1, :, pad:] for layer in self.cache.layers]
            seq.values = [layer.values[r:r + 1, :, pad:] for layer in self.cache.layers]
        self.cache = None

    def _pack(self) -> None:
        from transformers import DynamicCache

        self.width = max(s.length for s in self.running)
        self.pads = [self.width - s.length for s in self.running]
        self.cache = DynamicCache(config=self.x.lm.config)
        pad = torch.nn.functional.pad
        for i in range(self.x.layers):
            k = torch.cat([pad(s.keys[i], (0, 0, p, 0)) for s, p in zip(self.running, self.pads)])
            v = torch.cat([pad(s.values[i], (0, 0, p, 0)) for s, p in zip(self.running, self.pads)])
            self.cache.update(k, v, i)
        for s in self.running:
            s.keys = s.values = []

    def step(self) -> None:
        """One decode step of every running request (after admitting those whose KV cache came);
        with none running, a short wait on the data socket for one to come."""
        self._admit()
        if not self.running:
            if self.waiting:
                _links(self.links).receive(WAITING_POLL_MS)
            return
        try:
            self._step()
        except Exception as err:  # the whole batch failed: every member is told, the agent goes on
            self.cache = None
            failed, self.running = self.running, []
            for seq in failed:
                self.answer(seq.msg, PhaseRequestError(f"decode step failed: {type(err).__name__}: {err}"))

    @torch.inference_mode()
    def _step(self) -> None:
        if self.cache is None:
            self._pack()
        rows = len(self.running)
        ids = torch.tensor([[s.token] for s in self.running], dtype=torch.long)
        mask = torch.ones(rows, self.width + 1, dtype=torch.long)
        for r, p in enumerate(self.pads):
            mask[r, :p] = 0
        positions = torch.tensor([[s.length] for s in self.running], dtype=torch.long)
        with emulated(self.slowdown):
            out = self.x.lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                            use_cache=True)
            logits = out.logits[:, -1]
            tokens = [int(sample(logits[r:r + 1], s.params, s.generator)[0]) for r, s in enumerate(self.running)]
        now = self.clock()
        self.width += 1
        for s, token in zip(self.running, tokens):
            s.token, s.length = token, s.length + 1
            s.tokens.append(token)
            s.ends.append(now)
        finished = [s for s in self.running if s.done()]
        if finished:
            self._unpack()
            self.running = [s for s in self.running if not s.done()]
            for s in finished:
                self._finish(s)

    def _finish(self, seq: _Sequence) -> None:
        seq.keys = seq.values = []
        msg = seq.msg
        self.answer(msg, TokensDecoded(req=msg.req, request=msg.request, tokens=tuple(seq.tokens),
                                       step_ends=tuple(seq.ends), t_start=seq.t_start, t_end=self.clock(),
                                       kv_received=seq.received))


class CoupledExecutor(_PhaseExecutor):
    """Several phases on one agent: PD-only's encode + prefill (DistServe-style) or the aggregated
    layout's all three. The same executors as the disaggregated pools, prefill and decode sharing
    one text model; what one phase hands the next (multimodal tokens, the KV cache) stays on the
    agent (``PhaseLinks.send`` to itself puts it in its own store) instead of crossing a link."""

    def __init__(self, model_dir: str, start: int = 0, end: int = 1, *, phases: tuple[str, ...],
                 dtype: str = "float32", threads: int | None = None, progress=None) -> None:
        if tuple(phases) not in COUPLED_KINDS:
            raise PhaseRequestError(f"no coupled stage serves {', '.join(phases)}")
        self.phase = "+".join(phases)
        self.kind = COUPLED_KINDS[tuple(phases)]
        encode = EncodeExecutor(model_dir, dtype=dtype, threads=threads)
        prefill = PrefillExecutor(model_dir, dtype=dtype, threads=threads)
        self.parts = {EncodeTiles: encode, PrefillPrompt: prefill}
        if "decode" in phases:
            self.parts[DecodeTokens] = DecodeExecutor.sharing(prefill)
        if progress:
            progress(1.0)

    def _modules(self):
        return tuple(dict.fromkeys(m for part in self.parts.values() for m in part._modules()))

    def decode_batch(self, **kwargs) -> DecodeBatch | None:
        decode = self.parts.get(DecodeTokens)
        return decode.decode_batch(**kwargs) if decode is not None else None

    def serve(self, msg, clock=time.time, slowdown: float = 1.0, links: PhaseLinks | None = None):
        part = self.parts.get(type(msg))
        if part is None:
            served = ", ".join(t.__struct_config__.tag for t in self.parts)
            raise PhaseRequestError(f"a {self.kind} agent serves {served}, not {msg.type_name()}")
        return part.serve(msg, clock=clock, slowdown=slowdown, links=links)


def resumed_sampler(msg: DecodeTokens, rng: bytes) -> tuple[SamplingParams, torch.Generator]:
    """A decode's sampling parameters and its generator, carrying on from the prefill's state ``rng``."""
    params = sampling_params(msg.sampling, msg.max_new_tokens)
    generator = params.make_generator()
    if rng:
        try:
            generator.set_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
        except (RuntimeError, ValueError) as err:
            raise PhaseRequestError(f"rng state not usable here ({err})") from None
    return params, generator


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


def encode_prefill_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None,
                            progress=None):
    return CoupledExecutor(model_dir, start, end, phases=("encode", "prefill"), dtype=dtype, threads=threads,
                           progress=progress)


def aggregated_executor(model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None):
    return CoupledExecutor(model_dir, start, end, phases=("encode", "prefill", "decode"), dtype=dtype,
                           threads=threads, progress=progress)
