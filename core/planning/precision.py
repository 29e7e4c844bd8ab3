"""What a stage's weight precision costs in memory, and which plans may ask for it.

A stage at ``int8``/``int4`` keeps its blocks' Linear weights in torchao's storage
(agents/weight_precision.py), everything else at the table's dtype:

- int8 (``Int8Tensor``): 1 byte per weight + a fp32 scale and an int8 zero point per output row;
- int4 (``Int4OpaqueTensor``): 4 bits per weight + a scale and a zero point at the activation
  dtype per output row and group of ``INT4_GROUP_SIZE`` inputs.

The agent's own count of what it holds after load (``StageExecutor.memory_bytes``) is what the
tests hold this against.
"""

from __future__ import annotations

from core.models.units import DTYPE_BYTES, ModelSpec, ModelUnit

QUANTIZABLE_FAMILIES = ("llama", "mistral", "qwen2")
"""The families whose blocks agents quantize (their Linears are what torchao's configs take)."""
INT4_GROUP_SIZE = 32
INT8_ROW_BYTES = 5
"""A fp32 scale and an int8 zero point per output row."""


def unit_weight_bytes(unit: ModelUnit, weights: str, table_dtype: str) -> int:
    """Bytes of ``unit``'s weights on a stage at ``weights`` precision, the rest at ``table_dtype``."""
    if weights == "fp" or not unit.linear_params or table_dtype not in ("fp32", "fp16", "bf16"):
        return unit.param_bytes
    element = DTYPE_BYTES[table_dtype]
    rest = unit.param_bytes - round(unit.linear_params * element)
    if weights == "int8":
        return rest + unit.linear_params + unit.linear_rows * INT8_ROW_BYTES
    if weights == "int4":
        groups = unit.linear_params // INT4_GROUP_SIZE
        return rest + unit.linear_params // 2 + round(groups * 2 * element)
    raise ValueError(f"unknown weight precision {weights!r}")


def stage_weight_bytes(model: ModelSpec, start: int, end: int, weights: str = "fp") -> int:
    """Bytes of the weights of units ``[start, end)`` at ``weights`` precision."""
    return sum(unit_weight_bytes(u, weights, model.dtype) for u in model.units[start:end])


def precision_problems(plan, model: ModelSpec) -> list[str]:
    """One line per stage whose weight precision this model cannot be loaded at (before any work)."""
    problems = []
    for i, s in enumerate(plan.stages):
        if s.weights == "fp":
            continue
        if model.family not in QUANTIZABLE_FAMILIES:
            problems.append(f"stage {i} ({s.device}) asks for {s.weights} weights: agents quantize "
                            f"{', '.join(QUANTIZABLE_FAMILIES)} models, this one is {model.family} (use fp)")
        elif s.weights == "int4" and model.hidden_size % INT4_GROUP_SIZE:
            problems.append(f"stage {i} ({s.device}) asks for int4 weights: they need a hidden size in groups of "
                            f"{INT4_GROUP_SIZE}, this model's is {model.hidden_size} (use int8 or fp)")
    return problems


# --- planning precision: which precisions a plan may give a device, and what they cost in time ----

def _quality(profile, weights: str):
    return next((q for q in profile.weight_quality if q.weights == weights), None)


def quantizable(model: ModelSpec, weights: str) -> bool:
    """Whether agents can load this model's blocks at ``weights`` (the same rules as ``precision_problems``)."""
    if weights == "fp":
        return True
    if model.family not in QUANTIZABLE_FAMILIES:
        return False
    return weights != "int4" or model.hidden_size % INT4_GROUP_SIZE == 0


def perplexity_increase(profile, weights: str) -> float | None:
    """``weights``' measured perplexity over fp's, less 1 (0.02 = 2 % higher); None: not measured."""
    fp, q = _quality(profile, "fp"), _quality(profile, weights)
    if fp is None or q is None:
        return None
    return q.perplexity / fp.perplexity - 1.0


def allowed_precisions(problem) -> tuple[str, ...]:
    """The weight precisions a plan for ``problem`` may give a device, fp first: fp alone without a
    quality bound; else also each measured precision the model can be loaded at whose perplexity is
    within the bound (EdgeMoE's rule for its bit widths: the accuracy loss bounded, the rest free)."""
    bound = problem.max_perplexity_increase
    if bound is None:
        return ("fp",)
    out = ["fp"]
    for w in ("int8", "int4"):
        rise = perplexity_increase(problem.profile, w)
        if rise is not None and rise <= bound * (1 + 1e-12) + 1e-12 and quantizable(problem.profile.model, w):
            out.append(w)
    return tuple(out)


def time_ratio(profile, weights: str, phase: str = "decode", device: str | None = None) -> float:
    """How much longer a decoder block computes at ``weights`` than at fp (1.0: fp, or not measured):
    ``device``'s own ratio where its profile has one (``Profile.precision_times``), else the one measured
    with the model's perplexity (``weight_quality``)."""
    if weights == "fp":
        return 1.0
    q = next((t for t in profile.precision_times if t.device == device and t.weights == weights), None) \
        if device is not None else None
    q = q or _quality(profile, weights)
    if q is None:
        return 1.0
    return q.decode_time_ratio if phase == "decode" else q.prefill_time_ratio


def unit_time_factors(profile, weights: str, phase: str = "decode", device: str | None = None) -> tuple[float, ...]:
    """Per unit, what its profiled time is multiplied by at ``weights`` (on ``device``): the blocks whose
    Linears are quantized (``linear_params``) take the measured ratio, the embedding and head stay at 1."""
    r = time_ratio(profile, weights, phase, device)
    return tuple(r if (u.linear_params and r != 1.0) else 1.0 for u in profile.model.units)


def quality_problems(problem, plan) -> list[str]:
    """One line per stage whose precision the problem's quality bound does not allow (empty without a bound)."""
    bound = problem.max_perplexity_increase
    if bound is None:
        return []
    allowed = allowed_precisions(problem)
    out = []
    for j, s in enumerate(plan.stages):
        if s.weights in allowed:
            continue
        rise = perplexity_increase(problem.profile, s.weights)
        why = "its perplexity is not measured" if rise is None else \
            f"it raises perplexity by {rise * 100:.2f} %, over the bound of {bound * 100:.2f} %"
        out.append(f"stage {j} ({s.device}) holds {s.weights} weights: {why}")
    return out
