"""EPD's memory model: what one agent of each pool holds, so a pool configuration is checked against
the devices' memory before it is searched or run.

What the agents hold (agents.techniques.phase_disaggregation.phases): an **encode** agent the vision
tower and projector, and the multimodal tokens of the request it encodes; a **prefill** agent the
text model, the multimodal tokens it receives and the KV cache of the prompts it prefills at once;
a **decode** agent the text model and one KV slot per sequence of its continuous batch, each as
long as the longest request's context (its batch cache is left padded to the longest row). An
agent serving several phases (``pd``'s encode + prefill, ``aggregated``'s all three) holds the
text model once. Weights come from the checkpoint's safetensors headers (nothing read), tokens
from the calibration (``PhaseCosts.mm_token_bytes``, ``kv_token_bytes``) and the workload.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

from core.errors import FormatError, UnsupportedModelError
from core.models.units import model_spec_from_config
from core.techniques.phase_disaggregation.types import EpdProblem, PhaseCosts, PhaseWeights, PoolConfig, Workload

MIB = 1 << 20
ENCODE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
"""Where a Llava checkpoint keeps what an encode agent loads (agents' ``VISION_PREFIXES`` and
``PROJECTOR_PREFIXES``); every other tensor is the text model's."""


def phase_weights(model_dir: str | Path, bytes_per_weight: int = 4) -> PhaseWeights:
    """A Llava checkpoint's weights split by phase, from its safetensors headers (no tensor read),
    and what encoding a tile holds, from its vision config; ``bytes_per_weight``: the run's dtype
    (float32: 4)."""
    import json

    from safetensors import safe_open

    files = [f for f in sorted(Path(model_dir).glob("*.safetensors")) if f.name.startswith("model")]
    if not files:
        raise FormatError(str(model_dir), "has no model*.safetensors: give the Llava checkpoint's directory")
    encode = text = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                n = prod(handle.get_slice(name).get_shape()) * bytes_per_weight
                if name.startswith(ENCODE_PREFIXES):
                    encode += n
                else:
                    text += n
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        vision = config["vision_config"]
        positions = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2 + 1  # the patches and CLS
        per_tile = (int(vision["num_hidden_layers"]) + 1) * positions * int(vision["hidden_size"]) * bytes_per_weight
        units = model_spec_from_config(config["text_config"], "fp32" if bytes_per_weight == 4 else "fp16").units
    except (OSError, ValueError, KeyError, TypeError, UnsupportedModelError) as err:
        raise FormatError(str(model_dir), f"config.json has no usable vision or text config ({err}): is it a Llava "
                                          "model?")
    return PhaseWeights(encode_bytes=encode, text_bytes=text, encode_bytes_per_tile=per_tile,
                        prefill_bytes_per_token=max(u.workspace_bytes_per_token for u in units))


def device_memory(weights: PhaseWeights, costs: PhaseCosts, workload: Workload, config: PoolConfig) -> dict[str, int]:
    """Bytes each device of ``config`` holds at most serving ``workload``: its phases' weights (the
    text model once) plus its tokens: an encode device one request's multimodal tokens and its tiles'
    hidden states (``encode_bytes_per_tile``), a prefill device ``prefill_batch`` requests' multimodal
    tokens, KV cache and workspace, a decode device ``decode_batch`` KV slots of the longest context."""
    mm = max(costs.mm_tokens(r) for r in workload.requests)
    tiles = max(r.tiles for r in workload.requests)
    prefill = max(costs.prefill_tokens(r) for r in workload.requests)
    context = max(costs.prefill_tokens(r) + r.output_tokens for r in workload.requests)
    need: dict[str, int] = {}
    for device in config.devices:
        weights_bytes, tokens = 0, 0
        if device in config.encode:
            weights_bytes += weights.encode_bytes
            tokens += mm * costs.mm_token_bytes + tiles * weights.encode_bytes_per_tile
        if device in config.prefill or device in config.decode:
            weights_bytes += weights.text_bytes
        if device in config.prefill:
            tokens += config.prefill_batch * (mm * costs.mm_token_bytes
                                              + prefill * (costs.kv_token_bytes + weights.prefill_bytes_per_token))
        if device in config.decode:
            tokens += config.decode_batch * context * costs.kv_token_bytes
        need[device] = weights_bytes + tokens
    return need


def problem_memory(problem: EpdProblem, config: PoolConfig) -> dict[str, int]:
    """``device_memory`` of ``config`` for the problem's model and workload ({} without weights)."""
    if problem.weights is None:
        return {}
    return device_memory(problem.weights, problem.costs, problem.workload, config)


def over_budget(need: dict[str, int], budget_bytes: int) -> str:
    """Why ``need`` does not fit devices of ``budget_bytes`` each ('' when it fits; 0: unbounded)."""
    if not budget_bytes:
        return ""
    over = {d: b for d, b in need.items() if b > budget_bytes}
    if not over:
        return ""
    worst = max(over, key=over.get)
    return (f"{len(over)} device(s) need more than their {budget_bytes / MIB:.3g} MiB memory budget ({worst}: "
            f"{over[worst] / MIB:.1f} MiB): use smaller decode or prefill batches or devices with more memory")


__all__ = ["ENCODE_PREFIXES", "device_memory", "over_budget", "phase_weights", "problem_memory"]
