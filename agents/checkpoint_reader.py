"""Read an HF checkpoint directory on the device: its config and only the tensors asked for.

An agent holds a slice of the model, so it must never materialise the whole state dict:
tensors are read one by one with ``safetensors.safe_open(...).get_tensor`` from
``model.safetensors`` or the shards named in ``model.safetensors.index.json``. This module
knows the on-disk names of each supported family (``FamilyLayout``) and maps old layouts
(Mixtral's per-expert ``block_sparse_moe`` weights) to what transformers 5 modules expect.
Agents ship alone, so errors are this module's own ``CheckpointError`` (core wraps them).
"""

from __future__ import annotations

import math

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from agents.checkpoint_files import CheckpointError, tensor_files

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "mixtral")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a name such as "float32" or "bf16"; a clear error otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class FamilyLayout:
    """Where a family keeps its parts, as attribute names on the HF model and key prefixes on disk."""

    base: str
    """Attribute of the ForCausalLM holding the decoder stack ("model" or "transformer")."""
    embed: str
    positions: str | None
    """Learned absolute position embedding (GPT-2's wpe), added on the first stage."""
    blocks: str
    norm: str
    rotary: str | None
    """Rotary embedding module, computed outside the layers from position ids (transformers 5)."""


LAYOUTS: dict[str, FamilyLayout] = {
    "llama": FamilyLayout("model", "embed_tokens", None, "layers", "norm", "rotary_emb"),
    "mistral": FamilyLayout("model", "embed_tokens", None, "layers", "norm", "rotary_emb"),
    "qwen2": FamilyLayout("model", "embed_tokens", None, "layers", "norm", "rotary_emb"),
    "mixtral": FamilyLayout("model", "embed_tokens", None, "layers", "norm", "rotary_emb"),
    "gpt2": FamilyLayout("transformer", "wte", "wpe", "h", "ln_f", None),
}


def load_config(model_dir: str | Path):
    """The HF config of a supported family, set to sdpa attention (AutoConfig leaves it unset)."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not an HF checkpoint directory)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise CheckpointError(f"{path}/config.json: cannot be read: {err}") from None
    if config.model_type not in LAYOUTS:
        raise CheckpointError(
            f"{path}: model family {config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    config._attn_implementation = "sdpa"
    return config


def read_generation_defaults(model_dir: str | Path) -> dict:
    """eos/bos/pad token ids from generation_config.json (falling back to config.json)."""
    path = Path(model_dir)
    out: dict = {}
    for name in ("config.json", "generation_config.json"):  # later file wins
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                if data.get(key) is not None:
                    out[key] = data[key]
    eos = out.get("eos_token_id")
    out["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return out


class CheckpointReader:
    """Maps tensor names to safetensors files and reads single tensors on demand."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = tensor_files(self.model_dir)
        self.read_names: list[str] = []
        """Every tensor read so far, in order (lets tests check a stage read only its own)."""

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def read(self, names: list[str], dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Read the named tensors (grouped per file), converted to ``dtype``, onto ``device`` (a CUDA
        device: safetensors copies each tensor from the mapped file straight to it, no CPU copy)."""
        missing = [n for n in names if n not in self._file_of]
        if missing:
            raise CheckpointError(f"{self.model_dir}: tensors missing from checkpoint: {missing[:5]}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in sorted(by_file.items()):
            if not file.is_file():
                raise CheckpointError(f"{file}: shard named in the index is missing")
            with safe_open(str(file), framework="pt", device=device) as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    out[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
                    self.read_names.append(name)
        return out

    def planned_bytes(self, names: list[str], dtype: torch.dtype) -> int:
        """Bytes the named tensors take once read as ``dtype``, from the files' headers: nothing is
        read, so a budget can be checked before any memory is taken."""
        return sum(math.prod(shape) for shape in self.shapes(names).values()) * dtype.itemsize

    def shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        """The named tensors' shapes from the files' headers (a missing one is left out: it is named
        when it is read)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name in self._file_of:
                by_file.setdefault(self._file_of[name], []).append(name)
        out: dict[str, tuple[int, ...]] = {}
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in file_names:
                    out[name] = tuple(f.get_slice(name).get_shape())
        return out

    def with_prefix(self, prefix: str) -> list[str]:
        return [n for n in self.names() if n.startswith(prefix)]


def block_state_dict(
    reader: CheckpointReader, family: str, key_prefix: str, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One decoder block's tensors keyed as the transformers 5 layer module names them.

    Mixtral checkpoints written in the old layout keep each expert as
    ``block_sparse_moe.experts.{e}.w1/w2/w3``; transformers 5 fuses them into
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (w1 then w3 per expert) and
    ``mlp.experts.down_proj`` [E, H, I], and renames ``block_sparse_moe`` to ``mlp``.
    """
    names = reader.with_prefix(key_prefix)
    if not names:
        raise CheckpointError(f"{reader.model_dir}: no tensors under {key_prefix!r}")
    raw = reader.read(names, dtype, device)
    local = {name[len(key_prefix):]: t for name, t in raw.items()}
    if family != "mixtral" or not any(k.startswith("block_sparse_moe.") for k in local):
        return local
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in local.items():
        if key.startswith("block_sparse_moe.experts."):
            _, _, index, which, _ = key.split(".")
            experts.setdefault(int(index), {})[which] = tensor
        else:
            out[key.replace("block_sparse_moe.", "mlp.", 1)] = tensor
    order = sorted(experts)
    if order != list(range(len(order))):
        raise CheckpointError(f"{reader.model_dir}: experts under {key_prefix!r} are not 0..E-1")
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([experts[e]["w1"], experts[e]["w3"]], dim=0) for e in order]
    )
    out["mlp.experts.down_proj"] = torch.stack([experts[e]["w2"] for e in order])
    return out
