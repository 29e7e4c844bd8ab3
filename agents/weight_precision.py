"""Weight-only int8 / int4 for a layer-sharding stage, quantized at load with torchao.

A stage reads its fp slice of the checkpoint as always, then quantizes each decoder block's
``nn.Linear`` weights in place, block by block (so the fp copy of one block at most is held
beside the quantized ones). Exactly those: the embedding, the final norm and the LM head stay
at the stage's dtype (the head is often tied to the embedding, and it is the layer most
sensitive to rounding), as do norms and biases. The same model quantized in one process is
``torchao.quantization.quantize_(model.model.layers, config)`` with the config below: that is
the reference the tests and ``bench/precision.py`` compare tokens against.

- int8: ``Int8WeightOnlyConfig()`` -> ``Int8Tensor``: int8 per weight, one fp32 scale and one
  int8 zero point per output row.
- int4: ``PrototypeInt4WeightOnlyConfig(group_size=32)`` -> ``Int4OpaqueTensor``: two 4-bit
  weights per byte, packed for torch's own CPU kernel (``_weight_int4pack_mm_for_cpu``), a scale
  and a zero point at the activation dtype per row and group of 32 inputs. torchao 0.18's stable
  ``Int4WeightOnlyConfig`` has no CPU packing here (plain needs mslk, tile_packed_to_4d is CUDA,
  plain_int32 is XPU/NPU) and ``IntxWeightOnlyConfig`` keeps int4 values in int8 storage; the
  prototype config is the one that really stores 4 bits on CPU (its API may still move).
"""

from __future__ import annotations

import functools
import logging
import sys

PRECISIONS = ("fp", "int8", "int4")
"""``LoadShard.weights``: ``fp`` keeps the stage's dtype; the others quantize its blocks' Linears."""
INT4_GROUP_SIZE = 32
"""Inputs per int4 scale/zero point: every Linear's in-features must be a multiple of it."""
QUANTIZABLE_FAMILIES = ("llama", "mistral", "qwen2")
"""Families whose blocks compute through ``nn.Linear`` only (GPT-2's Conv1D and Mixtral's fused
experts are not what torchao's weight-only configs quantize)."""


class _CpuBuildNoise(logging.Filter):
    """Drops two kinds of log lines torchao's import causes (transformers imports torchao whenever it
    is installed, so every process that loads a model sees them): "Failed to load .../_C_*.so" for its
    CUDA kernel libraries when this torch is a CPU build (kept on a CUDA build, where they mean
    something), and torch's deprecation of the enums torchao registers with pytree."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "Failed to load" in text and ".so" in text:
            torch = sys.modules.get("torch")
            return torch is not None and getattr(torch.version, "cuda", None) is not None
        return "is an Enum subclass and is now natively supported" not in text


_NOISE = _CpuBuildNoise()


def quiet_cpu_build_noise() -> None:
    """Install the filter on torchao's and torch's pytree loggers (the standard logging API; torchao
    offers no switch of its own: ``TORCHAO_FORCE_SKIP_LOADING_SO_FILES`` logs a warning instead)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _NOISE not in logger.filters:
            logger.addFilter(_NOISE)


@functools.cache
def _torchao():
    """torchao's quantization API, imported on the first quantized load, never at the agent's start
    (transformers' model code imports torchao itself when it is installed: ~1.5 s at load 1.3)."""
    quiet_cpu_build_noise()
    import torchao.quantization as quantization
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

    return quantization, PrototypeInt4WeightOnlyConfig


def quantization_config(precision: str):
    """The torchao config of ``precision`` (``int8`` or ``int4``)."""
    quantization, int4_config = _torchao()
    if precision == "int8":
        return quantization.Int8WeightOnlyConfig()
    if precision == "int4":
        return int4_config(group_size=INT4_GROUP_SIZE, set_inductor_config=False)
    raise ValueError(f"weights must be one of {', '.join(PRECISIONS)}, got {precision!r}")


class UnquantizableWeights(ValueError):
    """A stage asked for int8/int4 weights its model's blocks cannot be quantized to."""


def check_quantizable(family: str, precision: str) -> None:
    if precision not in PRECISIONS:
        raise UnquantizableWeights(f"weights must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "fp" and family not in QUANTIZABLE_FAMILIES:
        raise UnquantizableWeights(f"{precision} weights are supported for {', '.join(QUANTIZABLE_FAMILIES)} "
                                   f"models, not {family}: load this stage with fp weights")


def quantize_block(block, precision: str) -> None:
    """Quantize every ``nn.Linear`` weight of one decoder block (an ``nn.Module``) in place (``fp``:
    nothing). torch and torchao are imported here: the protocol reads ``PRECISIONS`` without them."""
    if precision == "fp":
        return
    from torch import nn

    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    if precision == "int4":
        odd = sorted({m.in_features for m in linears if m.in_features % INT4_GROUP_SIZE})
        if odd:
            raise UnquantizableWeights(f"int4 weights need every Linear's inputs in groups of {INT4_GROUP_SIZE}; "
                                       f"this model has Linears of {odd} inputs: use int8 or fp")
    quantization, _ = _torchao()
    quantization.quantize_(block, quantization_config(precision))


def held_bytes(tensor) -> int:
    """Bytes a tensor really holds: a quantized weight's inner tensors (packed values, scales,
    zero points), not the logical size of the fp tensor it stands for."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(held_bytes(getattr(tensor, name)) for name in names)
    return tensor.nbytes


def quantized_bytes(shape: tuple[int, ...], precision: str, itemsize: int) -> int:
    """Bytes one ``nn.Linear`` weight of ``shape`` [out, in] holds once quantized to ``precision``, from
    its shape alone (a budget is checked before the weight is read): int8 one byte per weight, an fp32
    scale and an int8 zero point per row; int4 half a byte per weight, a scale and a zero point at the
    activation dtype (``itemsize``) per row and group of ``INT4_GROUP_SIZE`` inputs (equal to
    ``held_bytes`` of the quantized tensor: tests/agents/test_memory_budget.py)."""
    out, inputs = int(shape[0]), int(shape[1])
    if precision == "int8":
        return out * inputs + out * (4 + 1)
    if precision == "int4":
        return out * inputs // 2 + 2 * out * (-(-inputs // INT4_GROUP_SIZE)) * itemsize
    raise ValueError(f"{precision!r} weights are not quantized")


def is_quantized(tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(tensor)
