"""How a stage calls its decoder blocks, and what each gets beside the hidden states — the
attention mask and the rotary embeddings — equal to what transformers builds for the full model,
built cheaper.

A stage runs a step of a few blocks of a small model for a handful of rows, so what it does per
step beside the blocks' own arithmetic counts (the demo's 3-stage plan pays it three times where
``generate`` pays it once). The mask and rotary shortcuts first check their answer against
transformers' own and keep asking transformers where it differs, so the logits stay bit-identical;
a block runs its own ``forward``, only without wrappers that do nothing when a stage calls it.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
from torch.nn.modules import module as nn_module

PASSED_KEYWORDS = frozenset({"attention_mask", "position_ids", "use_cache", "position_embeddings"})
"""What a stage passes a block beside its cache (``StageExecutor._run_layer``): a deprecation of any
of them, or of the cache's keyword (``cache_keyword``), is not skipped."""


@functools.cache
def cache_keyword(fn) -> str:
    """The keyword ``fn`` takes the KV cache by: ``cache`` since transformers 5.24 (passing the
    deprecated ``past_key_values`` warns on every call, per layer and token), else the old name."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _inert(wrapper, passed: frozenset) -> bool:
    """Whether ``wrapper`` (a ``functools.wraps`` wrapper of a block's forward) does nothing for a
    stage's call: transformers' gradient checkpointing (a stage runs without gradients), or its
    deprecation of a keyword the stage does not pass (it only rewrites or warns about that one)."""
    code = getattr(wrapper, "__code__", None)
    if code is None:  # not a plain function (a decorator object): not known to be inert
        return False
    if code.co_name == "forward_with_checkpointing":
        return code.co_filename.endswith(os.path.join("transformers", "modeling_layers.py"))
    if code.co_name == "wrapped_func" and code.co_filename.endswith(os.path.join("transformers", "utils", "deprecation.py")):
        return inspect.getclosurevars(wrapper).nonlocals.get("old_name") not in passed
    return False


@functools.cache
def _unwrapped_forward(cls):
    forward, passed = cls.forward, PASSED_KEYWORDS | {cache_keyword(cls.forward)}
    while getattr(forward, "__wrapped__", None) is not None and _inert(forward, passed):
        forward = forward.__wrapped__
    return forward


def block_forward(block: torch.nn.Module):
    """What to call to run ``block``: its class's forward without the inert wrappers (``_inert``) and
    without ``Module.__call__``'s hook dispatch, or the block itself where it or torch has hooks, a
    compiled call or training mode: the same arithmetic, 14 µs of CPU less per block and step on the
    demo (a 3-block stage's decode step at 6 rows: 1010 -> 967 µs, load 3.6)."""
    if block.training or block._forward_hooks or block._forward_pre_hooks or block._backward_hooks \
            or block._backward_pre_hooks or block._compiled_call_impl is not None or nn_module._global_forward_hooks \
            or nn_module._global_forward_pre_hooks or nn_module._global_backward_hooks \
            or nn_module._global_backward_pre_hooks:
        return block
    return functools.partial(_unwrapped_forward(type(block)), block)

STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
"""Rotary types whose frequencies do not depend on the sequence's length (``dynamic`` and
``longrope`` rescale them as a sequence grows, so a table of past answers would go stale)."""

TABLE_POSITIONS = 8192
"""Positions a rotary table covers at most (2 × 4 bytes × head dim each); beyond, the module runs."""


class RotaryTable:
    """The rotary module's cos/sin looked up by position instead of computed every step.

    transformers computes them per forward from the position ids (a float product, a concat, cos,
    sin, a scale and two casts: 18.7 µs of CPU per stage step on the demo, 7.8 µs for two lookups).
    The table holds the module's own answer for positions ``0..n-1``, computed by the module in one
    call; both are elementwise over the same values, and the first lookup is compared with the
    module's answer for that step (``torch.equal``) before the table is trusted."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.usable = getattr(rotary, "rope_type", None) in STATIC_ROPE
        self.checked = False
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def embeddings(self, hidden: torch.Tensor, positions: torch.Tensor, upto: int):
        """(cos, sin) [B, n, D] for ``positions`` [B, n], every one below ``upto`` (the mask's width)."""
        if not self.usable or upto > TABLE_POSITIONS:
            return self.rotary(hidden, position_ids=positions)
        if self.cos is None or self.cos.shape[0] < upto or self.cos.dtype != hidden.dtype:
            size = min(max(256, 1 << (upto - 1).bit_length()), TABLE_POSITIONS)
            cos, sin = self.rotary(hidden[:1, :1], position_ids=torch.arange(size, device=hidden.device)[None])
            if cos.dim() != 3 or cos.shape[:2] != (1, size) or sin.shape != cos.shape:  # not [1, positions, D]
                self.usable = False
                return self.rotary(hidden, position_ids=positions)
            self.cos, self.sin = cos[0], sin[0]
        # the op F.embedding calls, without its Python checks (~2 µs a step less for the two)
        got = torch.embedding(self.cos, positions), torch.embedding(self.sin, positions)
        if not self.checked:
            made = self.rotary(hidden, position_ids=positions)
            self.checked, self.usable = True, all(torch.equal(a, b) for a, b in zip(got, made))
            return made
        return got


class DecodeMasks:
    """A one-token step's full-attention mask without transformers' mask factory (~0.1 ms per
    stage and token), once the factory was seen to give either the padding mask [B, 1, 1, T]
    itself or None (no padding under sdpa). Learnt separately for padded and unpadded masks,
    since the factory answers them differently and callers (a technique's executor that runs a
    step's blocks itself) tell None from an all-True mask."""

    def __init__(self, shortcut: bool = True):
        self.seen: dict[bool, str] = {} if shortcut else {True: "factory", False: "factory"}
        """unpadded? -> 'padding' | 'none' (build it directly) | 'factory' (always ask it)."""

    def mask(self, mask_2d: torch.Tensor, made, unpadded: bool | None = None):
        """``unpadded``: whether ``mask_2d`` is all ones, where the caller knows it (a decode step
        keeps what its micro-batch had: it appends an attended column); else it is computed."""
        if unpadded is None:
            unpadded = bool(mask_2d.all())
        seen = self.seen.get(unpadded)
        if seen == "none":
            return None
        padding = mask_2d.bool().reshape(mask_2d.shape[0], 1, 1, mask_2d.shape[1])
        if seen == "padding":
            return padding
        got = made()
        if seen is None:
            self.seen[unpadded] = "none" if got is None else "padding" if is_padding_mask(got, padding) else "factory"
        return got


def is_padding_mask(made, padding: torch.Tensor) -> bool:
    """Whether transformers' full-attention mask for a one-token decode step is the padding
    mask itself ([B, 1, 1, T], True = attend): then later decode steps build it directly
    instead of calling the mask factory (~0.1 ms per stage and token)."""
    return isinstance(made, torch.Tensor) and made.dtype == torch.bool and made.shape == padding.shape \
        and bool(torch.equal(made, padding))


def step_positions(mask: torch.Tensor, new: int) -> torch.Tensor:
    """The position ids [B, new] of a step's ``new`` columns from the group's attention mask [B, T], as HF
    generate counts them: attended tokens; padded slots get 0. A one-column step's column is attended on
    every path (decode appends it; prefill and extend check it), so its position is the row's count less
    one: one reduction, not cumsum, compare and fill of all. (A stage's decode step counts on from its last
    step's instead: ``agents.shard``'s ``_GroupState.grow``.)"""
    return mask.sum(-1, keepdim=True) - 1 if new == 1 else (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -new:]


class UnsupportedAttention(ValueError):
    """A block's attention type the stage cannot build a mask for."""


@functools.cache
def _masking():
    """transformers' mask factories' module (imported on first use: transformers loads lazily; an import
    statement per step and stage was ~1.5 µs of a middle stage's ~17 beside its blocks, hot)."""
    import transformers.masking_utils as masking

    return masking


def layer_inputs(config, layer_types, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
                 decode_masks: DecodeMasks, rotary_table: RotaryTable | None, unpadded: bool | None = None):
    """(masks by attention type, extra keywords) every block of a stage's step gets: the causal masks
    (``DecodeMasks`` for a one-token full-attention step) and the rotary embeddings (``rotary_table``).
    One path for a stage (``StageExecutor._layer_inputs``) and the profiler, which times what it costs."""
    masking = _masking()  # its functions read per call: what a caller patched there is what runs
    makers = {"full_attention": masking.create_causal_mask,
              "sliding_attention": masking.create_sliding_window_causal_mask}
    masks = {}
    for kind in sorted(set(layer_types)):
        if kind not in makers:
            raise UnsupportedAttention(f"attention type {kind!r} is not supported")
        maker = makers[kind]

        def made(maker=maker):
            return maker(config=config, inputs_embeds=hidden, attention_mask=mask, position_ids=positions,
                         **{cache_keyword(maker): cache})

        if kind == "full_attention" and hidden.shape[1] == 1:
            masks[kind] = decode_masks.mask(mask, made, unpadded)
        else:
            masks[kind] = made()
    extra = {}
    if rotary_table is not None:
        extra["position_embeddings"] = rotary_table.embeddings(hidden, positions, mask.shape[1])
    return masks, extra


def run_block(layer, hidden, mask, positions, cache, extra) -> torch.Tensor:
    """One decoder block of a step (``block_forward``), as a stage and the profiler run it."""
    hidden = block_forward(layer)(hidden, attention_mask=mask, position_ids=positions, use_cache=True,
                                  **{cache_keyword(type(layer).forward): cache}, **extra)
    if isinstance(hidden, tuple):  # older layer APIs return (hidden, ...)
        hidden = hidden[0]
    return hidden
