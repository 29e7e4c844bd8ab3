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
