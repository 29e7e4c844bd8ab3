"""Expert-offloading problems: a paper-shaped scenario (EdgeMoE's setting: a Mixtral-like model on a
phone-class device reading experts from flash; its sizes and times are assumptions), one built
from measurements (``from_profile``: the checkpoint's sizes and a device's profiled compute times),
and ``measured`` replacing a problem's assumed recall, bandwidth and bit options with the offline
profiles' measurements."""

from __future__ import annotations

from pathlib import Path

from core.techniques.expert_offload.problem import FULL_PRECISION, BitOption, MoeModel, OffloadProblem

ASSUMED_BIT_OPTIONS = (
    FULL_PRECISION,
    BitOption(name="int8", avg_bits=8.0, accuracy_loss=0.002),
    BitOption(name="int4", avg_bits=4.0, accuracy_loss=0.03),
    BitOption(name="mixed-2/4", avg_bits=3.0, accuracy_loss=0.045),
    BitOption(name="int2", avg_bits=2.0, accuracy_loss=0.30),
)
"""Illustrative only: measured ones come from ``edgeshard moe adapt-bits`` (``measured(bits=)``)."""


def paper_shaped(budget_fraction: float = 0.5, bandwidth_bps: float = 200e6) -> OffloadProblem:
    model = MoeModel(name="mixtral-like 8 experts, 8 blocks", layers=8, experts=8, top_k=2,
                     expert_bytes=3 * 1024 * 2816 * 4, resident_bytes=200_000_000,
                     layer_compute_s=0.004, expert_compute_s=0.003, head_s=0.01)
    full = model.resident_bytes + model.layers * model.experts * model.expert_bytes
    return OffloadProblem(model=model, device="phone", memory_budget_bytes=int(budget_fraction * full),
                          bandwidth_bps=bandwidth_bps, predictor_recall=0.6, bit_options=ASSUMED_BIT_OPTIONS)


def _json(path: str, expected: str) -> dict:
    import json

    from core.errors import FormatError

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as err:
        raise FormatError(path, f"cannot read it as JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != expected:
        raise FormatError(path, f"is not an {expected} file; make it with the matching edgeshard moe command")
    return data


def measured(problem: OffloadProblem, *, activations: str | None = None, storage: str | None = None,
             bits: str | None = None, storage_cache: str = "warm") -> OffloadProblem:
    """``problem`` with the offline profiles' measurements in place of its assumptions: the predictor's
    recall (profile-activations), the storage's read cost (profile-storage; its ``storage_cache`` reads:
    warm, as agents reading a checkpoint the host keeps cached find them, or cold), the bit options
    (adapt-bits).
    Each file is checked (format, values) and a bad one is a ``FormatError`` naming it."""
    import msgspec

    from core.errors import FormatError

    changes: dict = {}
    if activations:
        recall = _json(activations, "edgeshard.expert-activations").get("recall")
        if not isinstance(recall, (int, float)) or not 0 <= recall <= 1:
            raise FormatError(activations, f"recall must be a number in [0, 1] (got {recall!r}): profile again")
        changes["predictor_recall"] = float(recall)
    if storage:
        from core.techniques.expert_offload.profiling import storage_read_cost

        data = _json(storage, "edgeshard.storage-profile")
        try:
            bandwidth, fixed = storage_read_cost(data, storage_cache)
        except (KeyError, TypeError, ValueError):
            bandwidth, fixed = data.get("bandwidth_bps"), None
        if not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise FormatError(storage, f"bandwidth_bps must be > 0 (got {bandwidth!r}): profile again")
        if not (fixed or 0) >= 0:
            raise FormatError(storage, f"{storage_cache}.fixed_s must be >= 0 (got {fixed!r}): profile again")
        changes["bandwidth_bps"], changes["read_fixed_s"] = float(bandwidth), float(fixed or 0.0)
    if bits:
        raw = _json(bits, "edgeshard.expert-bits").get("options")
        try:
            options = msgspec.convert(raw, tuple[BitOption, ...])
        except msgspec.ValidationError as err:
            raise FormatError(bits, f"bad bit options ({err}): adapt again") from None
        if not options:
            raise FormatError(bits, "has no bit options: adapt again")
        changes["bit_options"] = options
    fields = {f: getattr(problem, f) for f in problem.__struct_fields__}
    return OffloadProblem(**{**fields, **changes})  # checked again (__post_init__), e.g. bits in [1, 32]


def _resident_and_expert_bytes(model_dir: str, config: dict) -> tuple[int, int]:
    """(bytes of every non-expert tensor, bytes of one expert), at fp32, from the checkpoint's
    safetensors headers (no weights read)."""
    from math import prod

    from safetensors import safe_open

    from core.errors import FormatError

    files = sorted(Path(model_dir).glob("*.safetensors"))
    files = [f for f in files if f.name.startswith("model")]
    if not files:
        raise FormatError(str(model_dir), "has no model*.safetensors: give the checkpoint directory")
    resident = 0
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if ".experts." not in name and not name.endswith((".gate_up_proj", ".down_proj")):
                    resident += 4 * prod(handle.get_slice(name).get_shape())
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    return resident, 3 * hidden * inter * 4


def from_profile(profile, device: str, model_dir: str, budget_fraction: float = 0.5,
                 bandwidth_bps: float = 200e6) -> OffloadProblem:
    """A problem from measurements instead of assumptions: the model's sizes from the checkpoint
    (``model_dir``), its compute times from the device's profile (``edgeshard profile``: each unit's
    decode time at batch 1, and one expert's time the agent measured for MoE blocks), so
    ``layer_compute_s`` = a block's time − top_k experts, averaged over the blocks; and the blocks'
    and the rest's times at each batch size and prompt-token count profiled (a run's steps). Bad input
    (another model's profile, a device not in it, a profile without expert times) is a
    ``FormatError`` naming what to do."""
    import json

    from core.errors import FormatError

    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise FormatError(str(config_path), f"cannot read the model's config ({err})") from None
    if "num_local_experts" not in config:
        raise FormatError(str(model_dir), "is not a MoE (Mixtral) checkpoint: expert offloading needs one")
    layers, experts = int(config["num_hidden_layers"]), int(config["num_local_experts"])
    top_k = int(config.get("num_experts_per_tok", 2))
    devices = [t.device for t in profile.times]
    if device not in devices:
        raise FormatError("profile", f"has no compute times of device {device!r} (it has {', '.join(devices)})")
    times = profile.times_of(device)
    if len(times.decode_s) != layers + 2:
        raise FormatError("profile", f"is for a model of {len(times.decode_s)} units; {model_dir} has {layers + 2}: "
                                     "profile this model")
    blocks = range(1, layers + 1)
    if len(times.expert_decode_s) != layers + 2 or not all(times.expert_decode_s[u] > 0 for u in blocks):
        raise FormatError("profile", f"has no per-expert compute time for {device!r}'s MoE blocks: profile the "
                                     "model again (agents time one expert of each MoE block)")
    expert_s = sum(times.expert_decode_s[u] for u in blocks) / layers
    layer_s = sum(max(0.0, times.decode_time(u, 1) - top_k * times.expert_decode_s[u]) for u in blocks) / layers
    head_s = times.decode_time(0, 1) + times.decode_time(layers + 1, 1) + times.stage_decode_overhead_s
    resident, expert_bytes = _resident_and_expert_bytes(model_dir, config)

    def curve(sizes, times_of, overhead):  # (block averaged over the blocks, the rest) per measured size
        return (tuple(sum(times_of(u, x) for u in blocks) / layers for x in sizes),
                tuple(times_of(0, x) + times_of(layers + 1, x) + overhead for x in sizes))

    decode_blocks, decode_head = curve(times.decode_batch_sizes, times.decode_time, times.stage_decode_overhead_s)
    prefill_blocks, prefill_head = curve(times.prefill_token_counts, times.prefill_time, times.stage_prefill_overhead_s)
    model = MoeModel(name=f"{Path(model_dir).name} (profiled on {device})", layers=layers, experts=experts,
                     top_k=top_k, expert_bytes=expert_bytes, resident_bytes=resident, layer_compute_s=layer_s,
                     expert_compute_s=expert_s, head_s=head_s, decode_batch_sizes=tuple(times.decode_batch_sizes),
                     block_decode_s=decode_blocks, head_decode_s=decode_head,
                     prefill_token_counts=tuple(times.prefill_token_counts), block_prefill_s=prefill_blocks,
                     head_prefill_s=prefill_head)
    full = resident + layers * experts * expert_bytes
    return OffloadProblem(model=model, device=device, memory_budget_bytes=int(budget_fraction * full),
                          bandwidth_bps=bandwidth_bps, bit_options=(FULL_PRECISION,))  # measured ones: --bits
