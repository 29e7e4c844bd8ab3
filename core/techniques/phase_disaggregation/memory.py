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
        per_tile = encode_bytes_per_tile(config["vision_config"], int(config["text_config"]["hidden_size"]),
                                         bytes_per_weight)
        per_token = prefill_bytes_per_token(config["text_config"], bytes_per_weight)
    except (OSError, ValueError, KeyError, TypeError, UnsupportedModelError) as err:
        raise FormatError(str(model_dir), f"config.json has no usable vision or text config ({err}): is it a Llava "
                                          "model?")
    return PhaseWeights(encode_bytes=encode, text_bytes=text, encode_bytes_per_tile=per_tile,
                        prefill_bytes_per_token=per_token)


def prefill_bytes_per_token(text: dict, bytes_per_weight: int = 4) -> int:
    """What a prefill holds per prompt token at its peak beside the weights and its KV cache, from the
    text config: the larger of the forward's (at a Llama block's MLP: gate's activation, up's output
    and their product, 3 × intermediate, beside 4 × hidden: the prompt's embeddings, the residual,
    its norm and the attention's sum) and the hand-off's (the cache stacked into one tensor and the
    bytes it is sent as: 2 × the KV). Against the live tensors of a prefill and the prefill agent's
    RSS (bench/memory_fidelity.py); layer sharding's unit workspace (2 × intermediate) left out the
    third MLP temporary and the hidden states, 1.35–1.61× on the prefill agent."""
    spec = model_spec_from_config(text, "fp32" if bytes_per_weight == 4 else "fp16")
    forward = (3 * int(text["intermediate_size"]) + 4 * spec.hidden_size) * bytes_per_weight
    return max(forward, 2 * sum(u.kv_bytes_per_token for u in spec.units))


def encode_bytes_per_tile(vision: dict, text_hidden: int, bytes_per_weight: int = 4) -> int:
    """What encoding one tile holds at its peak beside the weights, from the vision config: every
    layer's hidden states (Llava reads its feature layer from them; transformers keeps them all) and,
    on top, the largest step's temporaries: a CLIP layer's MLP (its input's norm, fc1's output and
    quick-GELU's two temporaries: hidden + 3 × intermediate per position), its attention (norm, q, k,
    v, SDPA's output and its contiguous copy: 6 × hidden) or the projector's (the feature layer's
    patches copied, linear_1's output and the activation's: hidden + 2 × text hidden per patch).
    Against the peak of live tensors in an encode (``tests/techniques/phase_disaggregation/
    test_memory.py``), and of RSS as the encode agent maps each block it frees back to the OS
    (``agents.heap.blocks_returned``); with the tile's pixels, which arrive as bytes and are copied
    into a tensor."""
    hidden, inner = int(vision["hidden_size"]), int(vision["intermediate_size"])
    patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    positions = patches + 1  # and CLS
    states = (int(vision["num_hidden_layers"]) + 1) * positions * hidden
    layer = positions * max(hidden + 3 * inner, 6 * hidden)
    projector = patches * (hidden + 2 * text_hidden)
    pixels = 2 * 3 * int(vision["image_size"]) ** 2  # the tile as it arrives and as a tensor
    return (states + max(layer, projector) + pixels) * bytes_per_weight


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
        if device in config.encode:  # its tokens twice: the tensor and the bytes it is sent as
            weights_bytes += weights.encode_bytes
            tokens += 2 * mm * costs.mm_token_bytes + tiles * weights.encode_bytes_per_tile
        if device in config.prefill or device in config.decode:
            weights_bytes += weights.text_bytes
        if device in config.prefill:
            tokens += config.prefill_batch * (2 * mm * costs.mm_token_bytes  # as they came and concatenated
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


__all__ = ["ENCODE_PREFIXES", "device_memory", "encode_bytes_per_tile", "prefill_bytes_per_token", "over_budget", "phase_weights", "problem_memory"]
