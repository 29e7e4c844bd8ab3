"""One stage's part of a verify trip: rewind the micro-batch's KV cache to the committed length,
then run several new positions at once (a short prefill over the cache), keeping every position's
logits on the last stage (plain decoding keeps the last one only).

It works on ``agents.shard.StageExecutor`` itself (the layer-sharding stage): its cache, mask and
blocks are what a plain decode step uses, so a verified position computes what a decode step would."""

from __future__ import annotations

import torch

from agents.emulation import SlowedStage, emulated
from agents.shard import StageExecutor
from agents.stage_input import StageInputError


def rewind(cache, keep: int) -> None:
    """Drop every cached position from ``keep`` on (a reserved cache moves its length back)."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "keys", None) is None:
            continue
        have = layer.keys.shape[-2]
        if keep > have:
            raise StageInputError(f"cannot keep {keep} cached positions of {have}")
        if hasattr(layer, "kbuf"):  # agents.shard's reserved layer: its buffers stay, its length moves
            layer.length = keep
            layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
        elif keep < have:
            layer.crop(keep - have)


@torch.inference_mode()
def verify(ex: StageExecutor, group: int, x: torch.Tensor, keep: int) -> torch.Tensor:
    """Run ``x`` ([B, n] ids on the first stage, [B, n, H] hidden after) over ``group``'s cache cut
    back to ``keep`` positions: hidden states [B, n, H], or on the last stage logits [B, n, V]. An
    emulated device's stage (``agents.emulation.SlowedStage``) is slowed as its decode steps are."""
    if isinstance(ex, SlowedStage):
        with emulated(ex.factor):
            return verify(ex._executor, group, x, keep)
    if type(ex) is not StageExecutor:
        raise StageInputError(f"speculative decoding runs on layer-sharding stages, not {type(ex).__name__}")
    state = ex._groups.get(group)
    if state is None:
        raise StageInputError(f"verify for micro-batch {group} before its prefill")
    if state.cache is not None:
        rewind(state.cache, keep)
    n = x.shape[1]
    ex._check_input(x, state.mask.shape[0], n)
    positions = None
    if ex._needs_positions:
        if keep > state.mask.shape[1]:
            raise StageInputError(f"cannot keep {keep} positions of {state.mask.shape[1]}")
        state.mask = torch.cat([state.mask[:, :keep], state.mask.new_ones((state.mask.shape[0], n))], dim=1)
        positions = (state.mask.cumsum(-1) - 1).masked_fill(state.mask == 0, 0)[:, -n:]
    x = x.to(ex.device)
    hidden = ex._embed_tokens(x, positions) if ex.is_first else x.to(ex.dtype)
    if ex._layers:
        hidden = ex._run_layers(state, hidden, positions)
    if not ex.is_last:
        return ex._to_host(hidden)
    return ex._to_host(ex._head(ex._norm(hidden)).float())
