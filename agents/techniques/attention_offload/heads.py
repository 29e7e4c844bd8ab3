"""Attention offloading (Lamina): the model split at the attention operator.

A *dense* side (``DenseExecutor``) runs embedding, projections, MLPs, norms and the head of
its units, and holds **no KV cache**: its blocks call a registered transformers attention
function that hands q and the new k, v of every layer to the *attention* sides and gets
the attention output back. Each ``AttentionStore`` holds the KV cache of a contiguous
range of key/value heads (and their query heads) for every layer and computes attention
for them with transformers' own SDPA function, so the split needs no model code patched:
``AttentionInterface``/``AttentionMaskInterface`` name the function, a cache layer that
stores nothing keeps the lengths transformers asks for (PLATFORM-NOTES.md).

Per token and layer only (2·h_q + 2·h_kv)·head_dim elements cross between the two sides,
whatever the context length: ``HeadRouter.wire_bytes`` counts them as they are handed over.
The attention sides are anything with ``attend``/``drop`` (in one process: the stores
themselves), so the same dense side serves in-process tests and, later, remote memory agents.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from agents.checkpoint_reader import CheckpointError, load_config
from agents.shard import StageExecutor
from agents.stage_input import ReservationExceeded, StageInputError
from agents.techniques.attention_offload.messages import DENSE_KIND, MEMORY_KIND  # noqa: F401  (public here too)

ATTENTION_FUNCTION = "edgeshard-attention-offload"
"""The name under which the offloading attention function is registered with transformers."""


@dataclass(frozen=True)
class HeadShape:
    """The attention geometry of a checkpoint: what the split and the wire sizes follow."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.q_heads // self.kv_heads

    @classmethod
    def of(cls, model_dir: str) -> "HeadShape":
        config = load_config(model_dir)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(layers=int(config.num_hidden_layers), q_heads=heads, kv_heads=kv, head_dim=head_dim)

    def wire_elements_per_token_layer(self) -> int:
        """q and the attention output (h_q each), the new k and v (h_kv each): Lamina's traffic."""
        return (2 * self.q_heads + 2 * self.kv_heads) * self.head_dim


def split_heads(kv_heads: int, sides: int) -> list[range]:
    """Key/value heads split as evenly as possible over ``sides`` attention sides (balanced by heads)."""
    if sides < 1:
        raise ValueError("at least one attention side is needed")
    if sides > kv_heads:
        raise CheckpointError(f"{sides} attention sides for {kv_heads} key/value heads: "
                              f"use at most {kv_heads} memory devices (one head each) for this model")
    base, extra = divmod(kv_heads, sides)
    ranges, start = [], 0
    for i in range(sides):
        end = start + base + (1 if i < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


class AttentionSide(Protocol):
    """What the dense side calls per layer: an in-process ``AttentionStore`` or a remote one."""

    kv_heads: range

    def attend(self, group: int, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float) -> torch.Tensor: ...

    def drop(self, group: int, layers: Sequence[int] | None = None) -> None: ...


class _HeadGroup(torch.nn.Module):
    """What transformers' SDPA function reads from an attention module: GQA group and causality."""

    def __init__(self, group: int):
        super().__init__()
        self.num_key_value_groups = group
        self.is_causal = True


class AttentionStore:
    """One memory side: the KV cache of key/value heads ``kv_heads`` (every layer, every group in
    flight) and attention over it. It never sees weights.

    ``reservation`` (``agents.protocol.KvReservation``: groups, sequences, context tokens): the
    whole cache is allocated now, zero-filled so it is resident (a memory agent's hold: what it
    promised is what it holds, and growth cannot take more), and a step beyond it is refused with
    ``ReservationExceeded`` naming both. Without one the cache grows per token, refused beyond
    ``budget_bytes`` (0: unbounded) before it grows."""

    def __init__(self, shape: HeadShape, kv_heads: range, reservation=None, budget_bytes: int = 0):
        if not kv_heads or kv_heads.start < 0 or kv_heads.stop > shape.kv_heads:
            raise CheckpointError(f"key/value heads {kv_heads.start}..{kv_heads.stop - 1} are not inside "
                                  f"the model's 0..{shape.kv_heads - 1}")
        self.shape, self.kv_heads = shape, kv_heads
        self._module = _HeadGroup(shape.group)
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.budget_bytes = budget_bytes
        self._free_slots: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._slot_of: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.reserved_bytes = 0
        if reservation is not None and reservation.groups > 0:
            dims = (reservation.sequences, len(kv_heads), reservation.context_tokens, shape.head_dim)
            self._free_slots = [[(torch.zeros(dims), torch.zeros(dims)) for _ in range(shape.layers)]
                                for _ in range(reservation.groups)]
            self.reserved_bytes = reserved_kv_bytes(shape, kv_heads, reservation)

    def _append(self, group: int, layer: int, key: torch.Tensor, value: torch.Tensor, past):
        """Everything cached for ``(group, layer)`` with ``key``/``value`` appended, within the
        reservation or the budget (checked before anything is written or allocated)."""
        if not self.reserved_bytes:
            if self.budget_bytes:
                need = self.kv_bytes() + 2 * key.nbytes + (2 * (past[0].nbytes + key.nbytes) if past else 0)
                if need > self.budget_bytes:  # the concatenation briefly holds the old and the new copy
                    raise ReservationExceeded(
                        f"key/value heads [{self.kv_heads.start}, {self.kv_heads.stop}) need {need / MIB:.2f} MiB "
                        f"of KV cache for this step, over the {self.budget_bytes / MIB:.2f} MiB memory budget: "
                        "use more memory agents, a smaller batch or a shorter context")
            if past is None:
                return key, value
            return torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)
        slot = self._slot_of.get(group)
        if slot is None:
            if not self._free_slots:
                raise ReservationExceeded(f"all {len(self._slot_of)} micro-batches' KV caches reserved for this hold "
                                          f"({self.reserved_bytes / MIB:.2f} MiB) are in use; group {group} needs one more")
            slot = self._slot_of[group] = self._free_slots.pop()
        kbuf, vbuf = slot[layer]
        start = 0 if past is None else past[0].shape[2]
        b, end = key.shape[0], start + key.shape[2]
        if b > kbuf.shape[0] or end > kbuf.shape[2]:
            raise ReservationExceeded(
                f"the KV cache reserved for this hold ({self.reserved_bytes / MIB:.2f} MiB: {kbuf.shape[0]} sequences "
                f"of {kbuf.shape[2]} tokens) cannot take {b} sequences of {end} tokens: hold heads for this run's "
                "batch and length")
        kbuf[:b, :, start:end] = key
        vbuf[:b, :, start:end] = value
        return kbuf[:b, :, :end], vbuf[:b, :, :end]

    @torch.inference_mode()
    def attend(self, group: int, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Append the new ``key``/``value`` [B, h, q, D] of ``layer`` and attend ``query`` [B, h·g, q, D]
        over everything cached: [B, q, h·g, D], as transformers' SDPA attention returns it."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        heads = len(self.kv_heads)
        if key.ndim != 4 or key.shape[1] != heads or query.shape[1] != heads * self.shape.group \
                or not 0 <= layer < self.shape.layers:
            raise StageInputError(f"attention side for heads {self.kv_heads.start}..{self.kv_heads.stop - 1} got "
                                  f"q {tuple(query.shape)}, k {tuple(key.shape)} for layer {layer}")
        past = self._cache.get((group, layer))
        if past is not None:
            if past[0].shape[0] != key.shape[0]:
                raise StageInputError(f"group {group} has {past[0].shape[0]} sequences cached, this step "
                                      f"sends {key.shape[0]}")
        key, value = self._append(group, layer, key, value, past)
        self._cache[(group, layer)] = (key, value)
        if mask is not None and mask.shape[-1] != key.shape[2]:
            raise StageInputError(f"mask covers {mask.shape[-1]} tokens, the cache holds {key.shape[2]}")
        out, _ = sdpa_attention_forward(self._module, query, key, value, mask, dropout=0.0, scaling=scaling)
        return out

    def drop(self, group: int, layers: Sequence[int] | None = None) -> None:
        """Forget ``group``'s cache (of ``layers`` only: dense sides sharded by layers share a store)."""
        for key in [k for k in self._cache if k[0] == group and (layers is None or k[1] in layers)]:
            del self._cache[key]
        if group in self._slot_of and not any(k[0] == group for k in self._cache):
            self._free_slots.append(self._slot_of.pop(group))

    def kv_bytes(self) -> int:
        """Bytes of KV cache this side holds now (measured on the tensors; a reservation: all of it)."""
        return self.reserved_bytes or sum(k.nbytes + v.nbytes for k, v in self._cache.values())

    def cached_tokens(self, group: int) -> int:
        entry = self._cache.get((group, 0))
        return 0 if entry is None else int(entry[0].shape[2])


MIB = 1 << 20


def reserved_kv_bytes(shape: HeadShape, kv_heads: range, reservation) -> int:
    """Bytes a hold of ``kv_heads`` reserves for ``reservation`` (float32 keys and values, every layer)."""
    return 2 * shape.layers * len(kv_heads) * shape.head_dim * reservation.groups * reservation.sequences \
        * reservation.context_tokens * 4


class HeadRouter:
    """The dense side's view of its attention sides: which side holds which heads, and the bytes
    handed over (q, k, v out; the attention output back)."""

    def __init__(self, shape: HeadShape, sides: Sequence[AttentionSide]):
        covered = sorted((s.kv_heads for s in sides), key=lambda r: r.start)
        if not covered or covered[0].start != 0 or covered[-1].stop != shape.kv_heads or any(
                a.stop != b.start for a, b in zip(covered, covered[1:])):
            raise CheckpointError("the attention sides' key/value heads must cover 0.."
                                  f"{shape.kv_heads - 1} once each, in ranges; got "
                                  f"{[(r.start, r.stop) for r in covered]}")
        self.shape = shape
        self.sides = sorted(sides, key=lambda s: s.kv_heads.start)
        self.wire_bytes = 0
        self.calls = 0

    def attend(self, group: int, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        g = self.shape.group
        outs = []
        for side in self.sides:
            h = side.kv_heads
            q = query[:, h.start * g:h.stop * g].contiguous()
            k, v = key[:, h.start:h.stop].contiguous(), value[:, h.start:h.stop].contiguous()
            out = side.attend(group, layer, q, k, v, mask, scaling)
            self.wire_bytes += q.nbytes + k.nbytes + v.nbytes + out.nbytes
            outs.append(out)
        self.calls += 1
        return torch.cat(outs, dim=2)

    def drop(self, group: int, layers: Sequence[int] | None = None) -> None:
        for side in self.sides:
            side.drop(group, layers)


def _offloaded_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs):
    """The attention function transformers calls in every block of a dense side."""
    route = getattr(module, "_offload_route", None)
    if route is None:
        raise CheckpointError("attention offloading is selected for a block that no dense side set up")
    executor, layer = route
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return executor.router.attend(executor.current_group, layer, query, key, value, attention_mask, scaling), None


@functools.cache
def register_attention_function() -> None:
    """Name the offloading attention function (and SDPA's mask) with transformers, once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_FUNCTION, _offloaded_attention)
    AttentionMaskInterface.register(ATTENTION_FUNCTION, sdpa_mask)


@functools.cache
def _lengths_only_layer_class():
    from transformers.cache_utils import DynamicLayer

    class LengthsOnlyLayer(DynamicLayer):
        """A cache layer that stores nothing: ``update`` passes the new k, v through (to the
        attention sides) and counts tokens, so masks and positions see the true past length."""

        def __init__(self):
            super().__init__()
            self.length = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device, self.is_initialized = key_states.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.length += key_states.shape[-2]
            return key_states, value_states

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.length, self.is_initialized = 0, False

    return LengthsOnlyLayer


class DenseExecutor(StageExecutor):
    """Units ``[start, end)`` with the attention operator of every block on attention sides.

    A ``StageExecutor`` in all else (same loading, masks, rotary, positions, stage API), so a
    dense side is a stage of a layer-sharded chain too; its caches hold lengths only."""

    def __init__(self, model_dir: str, start: int, end: int, *, sides: Sequence[AttentionSide],
                 dtype: str = "float32", threads: int | None = None, progress=None):
        register_attention_function()
        super().__init__(model_dir, start, end, dtype=dtype, threads=threads, progress=progress)
        self.shape = HeadShape.of(model_dir)
        self.router = HeadRouter(self.shape, sides)
        self.current_group = 0
        self._config._attn_implementation = ATTENTION_FUNCTION
        for layer, global_index in zip(self._layers, self.layer_indices):
            attention = getattr(layer, "self_attn", None) or getattr(layer, "attn")
            attention.config._attn_implementation = ATTENTION_FUNCTION
            attention._offload_route = (self, global_index)

    def _new_cache(self, group: int):
        from transformers.cache_utils import Cache

        return Cache(layers=[_lengths_only_layer_class()() for _ in self._layers])

    def prefill(self, group: int, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.router.drop(group, self.layer_indices)
        self.current_group = group
        return super().prefill(group, x, attention_mask)

    def decode(self, group: int, x: torch.Tensor) -> torch.Tensor:
        self.current_group = group
        return super().decode(group, x)

    def drop(self, group: int) -> None:
        super().drop(group)
        self.router.drop(group, self.layer_indices)

    def kv_bytes(self) -> int:
        """Bytes of key/value tensors this side's caches hold (measured: always 0)."""
        total = 0
        for state in self._groups.values():
            for layer in getattr(state.cache, "layers", []):
                for t in (layer.keys, layer.values):
                    if isinstance(t, torch.Tensor):
                        total += t.nbytes
        return total


def attention_stores(model_dir: str, sides: int) -> list[AttentionStore]:
    """``sides`` in-process memory sides over the model's key/value heads, balanced by heads."""
    shape = HeadShape.of(model_dir)
    return [AttentionStore(shape, heads) for heads in split_heads(shape.kv_heads, sides)]


def _tensor(data: bytes, shape: Sequence[int], dtype=torch.float32) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(shape))


def attend_frames(store: AttentionStore, msg) -> torch.Tensor:
    """Serve an ``agents.protocol.AttendHeads`` (sizes already checked by ``message_problem``)."""
    query = _tensor(msg.query, msg.q_shape)
    key, value = _tensor(msg.key, msg.kv_shape), _tensor(msg.value, msg.kv_shape)
    mask = _tensor(msg.mask, msg.mask_shape, torch.uint8).bool() if msg.mask_shape else None
    return store.attend(msg.group, msg.layer, query, key, value, mask, msg.scaling).contiguous()
