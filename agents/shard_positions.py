"""A layer-sharding stage's steps over several positions at once, with a rewind of its KV cache
(``agents.shard.StageExecutor`` inherits them): speculative decoding's verify trip runs the
proposed tokens in one step and drops the ones the target rejected before the next.

Apart from ``agents/shard.py`` because that file is at its size limit; these methods use the
executor's groups, checks and ``_run`` as its own ``decode`` does."""

from __future__ import annotations

import torch

from agents.stage_input import StageInputError


class PositionSteps:
    """``rewind`` and ``decode_positions`` of ``StageExecutor``."""

    def rewind(self, group: int, keep: int) -> None:
        """Cut ``group``'s KV cache and mask back to its first ``keep`` positions (speculative
        decoding drops the proposals the target rejected; a reserved cache keeps its buffers)."""
        state = self._groups.get(group)
        if state is None:
            raise StageInputError(f"rewind of micro-batch group {group} before its prefill")
        for layer in getattr(state.cache, "layers", None) or ():
            have = layer.get_seq_length() if getattr(layer, "keys", None) is not None else 0
            if keep > have:
                raise StageInputError(f"cannot keep {keep} cached positions of {have}")
            if hasattr(layer, "kbuf"):
                layer.length = keep
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            elif keep < have:
                layer.crop(keep - have)
        if self._needs_positions:
            if keep > state.mask.shape[1]:
                raise StageInputError(f"cannot keep {keep} positions of {state.mask.shape[1]}")
            state.mask, state.unpadded = state.mask[:, :keep], None

    @torch.inference_mode()
    def decode_positions(self, group: int, x: torch.Tensor, keep: int) -> torch.Tensor:
        """``rewind`` to ``keep`` positions, then run ``n`` new positions per sequence at once (a
        decode step of ``n`` tokens): hidden states [B, n, H], or on the last stage every
        position's logits [B, n, V] (speculative decoding's verify reads each one)."""
        self.rewind(group, keep)
        state = self._groups[group]
        self._check_input(x, state.mask.shape[0], x.shape[1])
        if self._needs_positions:
            state.mask = torch.cat([state.mask, state.mask.new_ones((state.mask.shape[0], x.shape[1]))], dim=1)
        return self._run(state, x, every_position=True)

    def cached(self, group: int) -> tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]]:
        """``group``'s cached length and, per decoder block of this stage (the model's layer index),
        its keys and values [B, KV heads, length, head dim]: what a test of the rewind compares."""
        state = self._groups.get(group)
        if state is None:
            raise StageInputError(f"no KV cache of micro-batch group {group}")
        layers = [(self.layer_indices[i], layer.keys, layer.values)
                  for i, layer in enumerate(getattr(state.cache, "layers", None) or ())
                  if getattr(layer, "keys", None) is not None and layer.keys.numel()]
        return (layers[0][1].shape[-2] if layers else 0), layers
