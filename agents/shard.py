"""Run a contiguous slice of a real HF model's units, with its own KV caches.

Units are the planner's: 0 = embedding, 1..L = decoder blocks, L+1 = final norm + LM
head; a stage runs ``[start, end)``. The stage builds the transformers 5 modules of its
units on the meta device (no memory, no random init), then assigns only its own tensors
read from the checkpoint, so a stage holding a quarter of the blocks holds a quarter of
their weights. safetensors hands out memory-mapped tensors; the stage then copies its
weights once into huge pages where the OS allows (``agents.huge_pages``: a stage idle
while others compute would otherwise pay for cold 4 KiB page translations on every step). Layers get LOCAL indices 0..k-1 (the KV cache is indexed by
``self_attn.layer_idx``), rotary embeddings and masks are computed per stage exactly as
the HF model computes them for the whole stack, so a chain of stages reproduces the whole
model's outputs (see ``agents.local_pipeline`` and the tests).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import nn

from agents.accelerators import CUDA
from agents.boundary_copy import BoundaryCopies
from agents.huge_pages import place_in_huge_pages
from agents.weight_precision import (
    UnquantizableWeights, check_quantizable, held_bytes, is_quantized, quantize_block, quantized_bytes,
)
from agents.shard_positions import PositionSteps
from agents.step_inputs import DecodeMasks, RotaryTable, UnsupportedAttention, layer_inputs, run_block, step_positions
from agents.stage_input import ReservationExceeded, StageInputError
from agents.checkpoint_reader import (
    LAYOUTS,
    CheckpointError,
    CheckpointReader,
    block_state_dict,
    load_config,
    torch_dtype,
)


MASK_ROOM = 64
"""Columns of ones a group's mask buffer holds beyond its mask (``_GroupState.grow``), at least."""


@dataclass
class _GroupState:
    cache: object | None
    mask: torch.Tensor
    """[B, past + new] 1/0 attention mask of everything this group has seen."""
    unpadded: bool | None = None
    """Whether ``mask`` is all ones, once known (a decode step keeps it; what else changes the mask resets it)."""
    _grown: torch.Tensor | None = None
    """The mask the last ``grow`` made: another in ``mask`` was set elsewhere (prefill, extend, keep_rows, rewind)."""
    _room: torch.Tensor | None = None
    """[B, >= past + 1] ones, ``mask`` in its first columns: a decode step's mask is a view of it."""
    _positions: torch.Tensor | None = None
    """[B, 1] the position ids of ``_grown``'s last column."""

    def grow(self) -> torch.Tensor:
        """A decode step: ``mask`` one attended column wider, and that column's position ids [B, 1], as
        ``step_positions`` counts them (the row's attended columns less one). A view of a buffer of ones and
        the last step's positions plus one (two ops a step; F.pad and a sum were three, ~4 µs of CPU a stage
        and step more, hot)."""
        mask = self.mask
        width = mask.shape[1] + 1
        if self._grown is not mask:
            self._positions = mask.sum(-1, keepdim=True)  # the new column's: every attended one before it
            self._room = None
        else:
            self._positions = self._positions + 1
        if self._room is None or self._room.shape[1] < width:
            self._room = mask.new_ones((mask.shape[0], width + max(MASK_ROOM, width)))
            self._room[:, :width - 1] = mask
        self.mask = self._grown = self._room[:, :width]
        return self._positions


@functools.cache
def _reserved_layer_class():
    """transformers' ``DynamicLayer`` writing into buffers allocated at load (built on first use:
    transformers loads lazily)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """One decoder block's KV cache in [S, H, C, D] key/value buffers reserved at load:
        ``update`` returns everything cached so far, as ``DynamicLayer`` does, but writes in
        place instead of concatenating, so a run never allocates KV cache."""

        def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor):
            super().__init__()
            self.kbuf, self.vbuf, self.length = kbuf, vbuf, 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            b, n = key_states.shape[0], key_states.shape[-2]
            end = self.length + n
            if b > self.kbuf.shape[0] or end > self.kbuf.shape[2] or key_states.shape[1:2] != self.kbuf.shape[1:2] \
                    or key_states.shape[-1] != self.kbuf.shape[-1]:
                raise ReservationExceeded(
                    f"the KV cache reserved at load holds {self.kbuf.shape[0]} sequences of {self.kbuf.shape[2]} "
                    f"tokens; this step needs {b} sequences of {end}: load the plan for this run's batch and length")
            self.kbuf[:b, :, self.length:end] = key_states
            self.vbuf[:b, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self.kbuf[:b, :, :end], self.vbuf[:b, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return int(self.kbuf.shape[2])

        def reset(self) -> None:
            self.length = 0
            self.keys = self.values = None
            self.is_initialized = False

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("a reserved KV cache is not cropped")

    return ReservedLayer


class StageExecutor(PositionSteps):
    """Holds units ``[start, end)`` of the model in ``model_dir`` and runs them per micro-batch group."""

    def __init__(
        self, model_dir: str, start: int, end: int, *, dtype: str = "float32", threads: int | None = None,
        progress=None, kv=None, huge_pages: bool = True, weights: str = "fp", budget=None,
        torch_device: str = "cpu", accelerators=None,
    ):
        """``progress(fraction)``, if given, is called as the stage's tensors are read (agents report it).

        ``huge_pages``: copy the weights into huge pages where the OS allows (``agents.huge_pages``);
        False keeps them memory-mapped from the checkpoint (benches compare the two).

        ``kv`` (``agents.protocol.KvReservation``): allocate the KV cache of ``kv.groups`` micro-batches
        of ``kv.sequences`` sequences up to ``kv.context_tokens`` tokens now (``kv_reserved_bytes``);
        a run beyond it is refused with ``StageInputError``. None: the cache grows per token.

        ``weights``: ``fp`` (the stage's dtype) or ``int8``/``int4``: each block's Linear weights are
        quantized as it is read (``agents.weight_precision``: which weights, how).

        ``budget(weight_bytes, kv_bytes)``, if given, is called before any tensor is read or any KV
        cache allocated, with what the stage will hold (``planned_bytes``: the checkpoint's header
        sizes); it raises to refuse the load, so a shard beyond a device's budget never takes its
        memory; quantized blocks (int8/int4) are planned at their quantized size from the headers' shapes.

        ``torch_device``: ``cpu`` or a CUDA device (``cuda``, ``cuda:N``): the stage's tensors are read
        from the checkpoint slice straight onto it, its KV cache lives there, and only the boundary
        activations cross to and from the host, through pinned buffers (``agents.boundary_copy``; its GPUs
        ``accelerators``, a ``CudaBackend``)."""
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(int(threads))
        config = load_config(model_dir)
        self.family: str = config.model_type
        try:
            check_quantizable(self.family, weights)
        except UnquantizableWeights as err:
            raise CheckpointError(str(err)) from None
        self.weights = weights
        if torch_device != "cpu" and weights == "int4":
            raise CheckpointError("int4 weights are packed for the CPU's kernel (Int4OpaqueTensor): load this stage "
                                  "on cpu, or at int8 or fp on the GPU")
        self.boundary = None if torch_device == "cpu" else BoundaryCopies(torch_device, accelerators or CUDA)
        self.device = torch.device("cpu") if self.boundary is None else self.boundary.device
        self.num_layers: int = int(config.num_hidden_layers)
        self.num_units: int = self.num_layers + 2
        if not (0 <= start < end <= self.num_units):
            raise CheckpointError(
                f"stage units [{start}, {end}) are not a non-empty range inside [0, {self.num_units})"
            )
        self.model_dir = str(model_dir)
        self.start, self.end = start, end
        self.is_first = start == 0
        self.is_last = end == self.num_units
        self.hidden_size: int = int(config.hidden_size)
        self.vocab_size: int = int(config.vocab_size)
        self.dtype = torch_dtype(dtype)
        self.layer_indices = list(range(max(start, 1) - 1, min(end, self.num_layers + 1) - 1))
        """Global indices of the decoder blocks this stage runs."""
        self._layout = layout = LAYOUTS[self.family]

        stage_config = copy.deepcopy(config)
        stage_config.num_hidden_layers = len(self.layer_indices)
        global_types = getattr(config, "layer_types", None)
        if global_types:
            stage_config.layer_types = [global_types[i] for i in self.layer_indices]
        self._config = stage_config
        self._layer_types = [self._layer_type(config, i) for i in self.layer_indices]

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(stage_config)
        base = getattr(skeleton, layout.base)

        self.reader = reader = CheckpointReader(model_dir)
        prefix = self._key_prefix(reader)
        if budget is not None:
            budget(self.planned_bytes(reader, prefix, config), kv_bytes=self._kv_bytes(config, kv))
        self._embed: nn.Module | None = None
        self._positions: nn.Module | None = None
        self._layers = nn.ModuleList()
        self._norm: nn.Module | None = None
        self._head: nn.Module | None = None
        self._rotary: nn.Module | None = None
        self._rotary_table: RotaryTable | None = None

        embed_weight: torch.Tensor | None = None
        if self.is_first:
            self._embed = getattr(base, layout.embed)
            embed_weight = self._assign(self._embed, reader, f"{prefix}{layout.embed}.")["weight"]
            if layout.positions:
                self._positions = getattr(base, layout.positions)
                self._assign(self._positions, reader, f"{prefix}{layout.positions}.")
        if self.layer_indices:
            blocks = getattr(base, layout.blocks)
            for local, global_index in enumerate(self.layer_indices):
                layer = blocks[local]
                state = self._block_state(layer, reader, f"{prefix}{layout.blocks}.{global_index}.", global_index)
                _load(layer, state, f"block {global_index}")
                self._fix_layer_index_dependent_scaling(layer, local, global_index)
                try:
                    quantize_block(layer, weights)
                except UnquantizableWeights as err:
                    raise CheckpointError(str(err)) from None
                self._layers.append(layer)
                if progress is not None:
                    progress((local + 1) / (len(self.layer_indices) + 1))
            if layout.rotary:
                self._rotary = type(getattr(base, layout.rotary))(config=stage_config).to(self.device)
                self._rotary_table = RotaryTable(self._rotary)
        if self.is_last:
            self._norm = getattr(base, layout.norm)
            self._assign(self._norm, reader, f"{prefix}{layout.norm}.")
            self._head = skeleton.lm_head
            if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in reader:
                if not getattr(config, "tie_word_embeddings", False):
                    raise CheckpointError(f"{model_dir}: lm_head.weight is missing and embeddings are not tied")
                if embed_weight is None:  # the head stage reads just the embedding tensor
                    name = f"{prefix}{layout.embed}.weight"
                    embed_weight = reader.read([name], self.dtype, str(self.device))[name]
                self._head.weight = nn.Parameter(embed_weight, requires_grad=False)
                if getattr(self._head, "bias", None) is not None:
                    self._assign(self._head, reader, "lm_head.", only=["bias"])
            else:
                self._assign(self._head, reader, "lm_head.")
        del skeleton, base, embed_weight  # the modules hold the weights: nothing else keeps their old memory
        for module in self._modules():
            module.eval()
            for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                if tensor.is_meta:
                    raise CheckpointError(f"{model_dir}: no weights for {name} of a stage module")
        self.huge_page_bytes = place_in_huge_pages(self._modules()) if huge_pages and self.device.type == "cpu" else 0
        """Bytes of weights moved into huge pages at load (0: left memory-mapped; agents.huge_pages)."""
        self._start_steps()
        if kv is not None and kv.groups > 0 and self._layers:
            self._reserve_kv(config, kv.groups, kv.sequences, kv.context_tokens)

    def _start_steps(self) -> None:
        """What a stage's steps keep beside its modules: its micro-batches' state, the mask shortcut, KV slots."""
        self._groups: dict[int, _GroupState] = {}
        self._decode_masks = DecodeMasks()
        self._free_slots: list[list] = []
        self._slot_of: dict[int, list] = {}
        self.kv_reserved_bytes = 0
        """Bytes of KV cache allocated at load (0 without a reservation)."""

    @classmethod
    def of_blocks(cls, config, blocks: list[nn.Module], rotary: nn.Module | None, dtype: torch.dtype,
                  device: torch.device) -> "StageExecutor":
        """A middle stage of decoder ``blocks`` built elsewhere, ``config`` their stage's config: the profiler's
        units (random weights from the config alone, no checkpoint) run their steps on a loaded stage's path."""
        stage = cls.__new__(cls)
        stage.is_first = stage.is_last = False
        stage.boundary, stage.device, stage.dtype, stage.model_dir = None, torch.device(device), dtype, "(units)"
        stage.hidden_size, stage._config, stage._layers = int(config.hidden_size), config, nn.ModuleList(blocks)
        stage._layer_types = [cls._layer_type(config, i) for i in range(len(blocks))]
        stage._rotary_table = RotaryTable(rotary) if rotary is not None else None
        stage._start_steps()
        return stage

    def planned_bytes(self, reader: CheckpointReader, prefix: str, config) -> int:
        """Bytes of weights this stage will hold at its dtype (its blocks' Linears quantized: at their
        quantized size), from the checkpoint's headers (a tied head counted once), plus the buffers a
        subclass allocates (``_planned_buffer_bytes``)."""
        layout = self._layout
        names: list[str] = []
        if self.is_first:
            names += reader.with_prefix(f"{prefix}{layout.embed}.")
            if layout.positions:
                names += reader.with_prefix(f"{prefix}{layout.positions}.")
        blocks = [n for index in self.layer_indices
                  for n in self._resident_names(reader.with_prefix(f"{prefix}{layout.blocks}.{index}."))]
        quantized = 0
        if self.weights != "fp":  # quantize_block quantizes exactly a block's Linear weights: its 2-D ones
            shapes = reader.shapes(blocks)
            linears = {n for n in blocks if n.endswith(".weight") and len(shapes.get(n, ())) == 2}
            quantized = sum(quantized_bytes(shapes[n], self.weights, self.dtype.itemsize) for n in linears)
            blocks = [n for n in blocks if n not in linears]
        names += blocks
        if self.is_last:
            names += reader.with_prefix(f"{prefix}{layout.norm}.")
            tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in reader
            names += reader.with_prefix("lm_head.") if not tied else (
                [] if self.is_first else [f"{prefix}{layout.embed}.weight"])
        return reader.planned_bytes(names, self.dtype) + quantized + self._planned_buffer_bytes()

    def _resident_names(self, block_names: list[str]) -> list[str]:
        """Of a block's tensors, the ones the stage keeps in memory (a subclass may keep some on storage)."""
        return block_names

    def _planned_buffer_bytes(self) -> int:
        """Memory a subclass allocates beside the weights at load or as it runs (e.g. an expert buffer)."""
        return 0

    def _kv_bytes(self, config, kv) -> int:
        """Bytes of KV cache a reservation ``kv`` takes on this stage (0 without one)."""
        if kv is None or kv.groups <= 0 or not self.layer_indices:
            return 0
        heads = int(getattr(config, "num_attention_heads"))
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // heads)
        return 2 * kv.groups * len(self.layer_indices) * kv.sequences * kv_heads * kv.context_tokens * head_dim \
            * self.dtype.itemsize

    def _reserve_kv(self, config, groups: int, sequences: int, context: int) -> None:
        """Zero-filled (so resident, not just promised) key/value buffers per group slot and block."""
        if sequences < 1 or context < 1:
            raise CheckpointError(f"a KV reservation needs sequences and context tokens >= 1 (got {sequences}, {context})")
        if any(t != "full_attention" for t in self._layer_types):
            raise CheckpointError(f"{self.model_dir}: KV reservation supports full-attention blocks only "
                                  f"(this stage has {sorted(set(self._layer_types))})")
        heads = int(getattr(config, "num_attention_heads"))
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // heads)
        shape = (sequences, kv_heads, context, head_dim)
        for _ in range(groups):
            self._free_slots.append([(torch.zeros(shape, dtype=self.dtype, device=self.device),
                                      torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self._layers])
        element = torch.empty((), dtype=self.dtype).element_size()
        self.kv_reserved_bytes = 2 * groups * len(self._layers) * sequences * kv_heads * context * head_dim * element

    def _new_cache(self, group: int):
        """A fresh cache for ``group``: a reserved slot when the stage reserved its KV cache."""
        from transformers import DynamicCache

        if not self.kv_reserved_bytes:
            return DynamicCache(config=self._config)
        from transformers.cache_utils import Cache

        slot = self._slot_of.get(group)
        if slot is None:
            if not self._free_slots:
                raise ReservationExceeded(
                    f"all {len(self._slot_of)} KV caches reserved at load are in use: the plan reserved that many "
                    "micro-batches in flight")
            slot = self._slot_of[group] = self._free_slots.pop()
        layer = _reserved_layer_class()
        return Cache(layers=[layer(k, v) for k, v in slot])

    # ----- construction helpers -------------------------------------------------------
    def _block_state(self, layer: nn.Module, reader: CheckpointReader, key_prefix: str, global_index: int) -> dict:
        """The tensors block ``global_index`` holds resident (a subclass may keep some elsewhere,
        e.g. a MoE block's experts on storage)."""
        return block_state_dict(reader, self.family, key_prefix, self.dtype, str(self.device))

    @staticmethod
    def _layer_type(config, index: int) -> str:
        types = getattr(config, "layer_types", None)
        if types:
            return types[index]
        return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"

    def _key_prefix(self, reader: CheckpointReader) -> str:
        """"model." / "transformer." as saved by transformers, or "" for checkpoints saved bare."""
        layout = self._layout
        for prefix in (f"{layout.base}.", ""):
            if f"{prefix}{layout.norm}.weight" in reader or f"{prefix}{layout.embed}.weight" in reader:
                return prefix
        raise CheckpointError(
            f"{self.model_dir}: no {layout.base}.{layout.embed}.weight in the checkpoint; "
            f"is this a {self.family} model?"
        )

    def _assign(self, module: nn.Module, reader: CheckpointReader, key_prefix: str, only=None) -> dict:
        names = list(module.state_dict().keys())  # parameters and persistent buffers
        if only is not None:
            names = [n for n in names if n in only]
        state = reader.read([key_prefix + n for n in names], self.dtype, str(self.device))
        state = {n[len(key_prefix):]: t for n, t in state.items()}
        _load(module, state, key_prefix.rstrip("."), strict=only is None)
        return state

    @staticmethod
    def _fix_layer_index_dependent_scaling(layer: nn.Module, local: int, global_index: int) -> None:
        # GPT-2 option: attention scaled by 1/(layer_idx+1); the layer was built with its local index.
        attn = getattr(layer, "attn", None)
        if attn is not None and getattr(attn, "scale_attn_by_inverse_layer_idx", False):
            attn.scaling = attn.scaling * (local + 1) / (global_index + 1)

    def _modules(self) -> list[nn.Module]:
        parts = [self._embed, self._positions, self._norm, self._head, self._rotary]
        return [m for m in parts if m is not None] + list(self._layers)

    # ----- the API ----------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of weights held (a tied embedding/head counted once; rotary tables not counted;
        a quantized weight by what it stores)."""
        seen: set[tuple] = set()
        total = 0
        for module in self._modules():
            for tensor in module.parameters():
                key = ("quantized", id(tensor)) if is_quantized(tensor) else ("plain", tensor.data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += held_bytes(tensor)
        return total

    @torch.inference_mode()
    def prefill(self, group: int, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Start a fresh KV cache for ``group`` and run the prompt (left padded) through the stage."""
        if attention_mask.ndim != 2:
            raise StageInputError(f"attention mask must be [B, T], got {tuple(attention_mask.shape)}")
        self._check_input(x, attention_mask.shape[0], attention_mask.shape[1])
        if attention_mask.numel() and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise StageInputError("attention mask must hold only 0 and 1")
        if attention_mask.shape[1] == 0 or not bool((attention_mask[:, -1] == 1).all()):
            # Decoder-only generation appends at the end: a right-padded row would get wrong tokens.
            raise StageInputError("every prompt must be non-empty and left-padded (mask[:, -1] == 1)")
        cache = self._new_cache(group) if self._layers else None
        state = _GroupState(cache=cache, mask=attention_mask.to(self.device, torch.long))
        self._groups[group] = state
        return self._run(state, x)

    def decode(self, group: int, x: torch.Tensor) -> torch.Tensor:
        """Run one new token per sequence; the group's mask grows by one attended column. In inference
        mode (a stage run's step already is) it is not entered again (a decorator's ~2 µs a step)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():  # this class's step, not ``self.decode``: a subclass's wrapper runs once
                return StageExecutor.decode(self, group, x)
        state = self._groups.get(group)
        if state is None:
            raise StageInputError(f"decode for micro-batch group {group} before its prefill")
        self._check_input(x, state.mask.shape[0], 1)
        # the head alone reads neither the mask nor positions (``_run``)
        return self._run(state, x, positions=state.grow() if self._needs_positions else None)

    @torch.inference_mode()
    def extend(self, group: int, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """A step of ``x.shape[1]`` new columns (``attention_mask`` [B, T], left-padded) on ``group``'s
        cache, rows beyond its own appended first (their past masked): requests joining a running batch."""
        state = self._groups.get(group)
        if state is None or self.kv_reserved_bytes or any(t != "full_attention" for t in self._layer_types):
            raise StageInputError(f"micro-batch {group} cannot take rows (not prefilled; a reserved or sliding cache)")
        new = attention_mask.shape[0] - state.mask.shape[0]
        self._check_input(x, attention_mask.shape[0], attention_mask.shape[1])
        if new < 0 or not bool((attention_mask[:, -1] == 1).all()):
            raise StageInputError("rows may only be appended, every one left-padded (mask[:, -1] == 1)")
        for layer in getattr(state.cache, "layers", None) or ():
            layer.keys, layer.values = (torch.cat([t, t.new_zeros((new, *t.shape[1:]))])
                                        for t in (layer.keys, layer.values))
        state.mask = torch.cat([torch.cat([state.mask, state.mask.new_zeros((new, state.mask.shape[1]))]),
                                attention_mask.to(self.device, torch.long)], dim=1)
        state.unpadded = None
        return self._run(state, x)

    def keep_rows(self, group: int, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of ``group`` (others are done), and drop the columns none of them attends."""
        state = self._groups[group]
        mask = state.mask[rows]
        first = int(mask.any(0).long().argmax()) if mask.numel() else mask.shape[1]
        state.mask, state.unpadded = mask[:, first:], None
        for layer in getattr(state.cache, "layers", None) or ():
            layer.keys, layer.values = (t[rows, :, first:].contiguous() for t in (layer.keys, layer.values))

    def drop(self, group: int) -> None:
        """Free the KV cache of ``group`` (unknown groups are ignored); a reserved one goes back to the pool."""
        self._groups.pop(group, None)
        slot = self._slot_of.pop(group, None)
        if slot is not None:
            self._free_slots.append(slot)

    def groups(self) -> list[int]:
        return sorted(self._groups)

    def kv_bytes(self) -> int:
        """Bytes of KV cache the live micro-batches hold now (what a finished one's drop frees)."""
        total = 0
        for state in list(self._groups.values()):
            for layer in getattr(state.cache, "layers", None) or ():
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total

    # ----- the computation ----------------------------------------------------------------
    def _check_input(self, x: torch.Tensor, batch: int, length: int) -> None:
        if self.is_first:
            if x.dtype != torch.int64 or tuple(x.shape) != (batch, length):
                raise StageInputError(
                    f"first stage expects token ids int64 [{batch}, {length}], got {x.dtype} {tuple(x.shape)}"
                )
            if x.numel() and any(not 0 <= int(v) < self.vocab_size for v in torch.aminmax(x)):
                raise StageInputError(f"token ids outside the vocabulary [0, {self.vocab_size})")
        elif not x.is_floating_point() or tuple(x.shape) != (batch, length, self.hidden_size):
            raise StageInputError(
                f"stage expects hidden states [{batch}, {length}, {self.hidden_size}], "
                f"got {x.dtype} {tuple(x.shape)}"
            )

    @property
    def _needs_positions(self) -> bool:
        """Whether a step computes positions (and grows the mask): not on a stage of the final
        norm and head alone, which reads neither (a decode step of the demo's head stage took
        133 µs of CPU with them, 108 without, its head 93; ×8 on the demo's emulated edge-c)."""
        return self.is_first or bool(self._layers)

    def _run(self, state: _GroupState, x: torch.Tensor, every_position: bool = False,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the step's position ids where the caller has them (a decode step: ``grow``)."""
        if positions is None and self._needs_positions:
            positions = step_positions(state.mask, x.shape[1])
        x = x if self.boundary is None else self.boundary.to_device(x)
        if self.is_first:
            hidden = self._embed_tokens(x, positions)
        else:
            hidden = x if x.dtype == self.dtype else x.to(self.dtype)
        if self._layers:
            hidden = self._run_layers(state, hidden, positions)
        if not self.is_last:
            return self._to_host(hidden)
        return self._to_host(self._head(self._norm(hidden)).float() if every_position else self._logits(hidden))

    def _to_host(self, out: torch.Tensor):
        """A GPU stage's output on its way to the host for the wire (``BoundaryCopies.to_host``); a CPU stage's as it is."""
        return out if self.boundary is None else self.boundary.to_host(out)

    def _embed_tokens(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self._embed(x)
        if self._positions is not None:
            hidden = hidden + self._positions(positions)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last position's logits [B, V] (final norm and LM head)."""
        return self._head(self._norm(hidden[:, -1:, :]))[:, -1, :].float()

    def _run_layers(self, state: _GroupState, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        masks, extra = self._layer_inputs(state, hidden, positions)
        for layer, kind in zip(self._layers, self._layer_types):
            hidden = self._run_layer(layer, hidden, masks[kind], positions, state.cache, extra)
        return hidden

    _run_layer = staticmethod(run_block)

    def _layer_inputs(self, state: _GroupState, hidden: torch.Tensor, positions: torch.Tensor):
        """The masks (by attention type) and rotary embeddings every block of a step gets (``layer_inputs``)."""
        if hidden.shape[1] == 1 and state.unpadded is None:
            state.unpadded = bool(state.mask.all())
        try:
            return layer_inputs(self._config, self._layer_types, hidden, state.mask, positions, state.cache,
                                self._decode_masks, self._rotary_table, state.unpadded)
        except UnsupportedAttention as err:
            raise CheckpointError(f"{self.model_dir}: {err}") from None


def _load(module: nn.Module, state: dict[str, torch.Tensor], what: str, strict: bool = True) -> None:
    try:
        module.load_state_dict(state, strict=strict, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights of {what} do not fit the config: {err}") from None
    for param in module.parameters():
        param.requires_grad_(False)
