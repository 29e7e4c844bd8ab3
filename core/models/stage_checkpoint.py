"""A stage's slice of a checkpoint: only the tensors of units [start, end), one file.

A device that runs units [start, end) needs only those weights, so the coordinator
uploads one ``model.safetensors`` holding them (plus ``config.json``) instead of the
whole model. Tensor names are kept as in the original checkpoint, so the agent's
checkpoint reader loads a stage directory like a full one. Two small extras always go
along: the final norm (a few KiB; the reader finds the key prefix by it) and, for a head
stage of a tied model, the embedding matrix that doubles as the LM head.

The file is written deterministically (same input → same bytes), which lets an
interrupted upload resume and be verified by its checksum.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from core.errors import FormatError

_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)(?:embed_tokens|wte|wpe)\.")
_NORM_RE = re.compile(r"(?:^|\.)(?:norm|ln_f)\.")


def unit_of_tensor(name: str, num_layers: int) -> int:
    """Unit index of a tensor name: 0 embedding, 1..L blocks, L+1 final norm + head."""
    m = _BLOCK_RE.search(name)
    if m:
        return int(m.group(1)) + 1
    if _EMBED_RE.search(name):
        return 0
    if name.startswith("lm_head.") or _NORM_RE.search(name):
        return num_layers + 1
    raise FormatError(name, "tensor belongs to no known unit (embedding, block, norm, head)")


def stage_tensor_names(names: list[str], config: dict, start: int, end: int) -> list[str]:
    num_layers = int(config.get("num_hidden_layers") or config.get("n_layer"))
    if not 0 <= start < end <= num_layers + 2:
        raise FormatError("stage", f"units [{start}, {end}) are not inside [0, {num_layers + 2})")
    head = num_layers + 1
    tied = bool(config.get("tie_word_embeddings", config.get("model_type") == "gpt2"))
    out = []
    for n in names:
        u = unit_of_tensor(n, num_layers)
        if start <= u < end:
            out.append(n)
        elif u == head and _NORM_RE.search(n) and not _BLOCK_RE.search(n):
            out.append(n)  # the final norm: tiny, and how the reader recognises the layout
        elif start <= head < end and tied and re.search(r"(?:embed_tokens|wte)\.weight$", n):
            out.append(n)  # tied LM head reads the embedding
    return sorted(set(out))


def _source_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, as the agents' reader finds them: ``model.safetensors`` or the
    shards its index names (other ``*.safetensors`` beside it, e.g. quantised experts, are not the model's)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise FormatError(str(index), f"cannot read the shard index ({err})") from None
        files = [model_dir / n for n in names]
    else:
        files = [f for f in (model_dir / "model.safetensors",) if f.is_file()] or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FormatError(str(model_dir), "no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def write_stage_checkpoint(model_dir: str | Path, start: int, end: int, cache_dir: str | Path) -> Path:
    """Write (or reuse) ``cache_dir/<model>-<start>-<end>/`` with config.json and model.safetensors."""
    import torch  # noqa: F401  (safetensors' torch API)
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as err:
        raise FormatError(str(cfg_path), f"cannot read the model config ({err})") from None
    files = _source_files(model_dir)
    h = hashlib.sha256()
    for f in files + [cfg_path]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = Path(cache_dir) / f"{model_dir.name}-{h.hexdigest()[:10]}-units-{start}-{end}"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                where[name] = f
    names = stage_tensor_names(sorted(where), config, start, end)
    tensors = {}
    for f in files:
        wanted = [n for n in names if where[n] == f]
        if wanted:
            with safe_open(str(f), framework="pt") as sf:
                for n in wanted:
                    tensors[n] = sf.get_tensor(n).contiguous()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "units": f"{start}-{end}"})
    shutil.copyfile(cfg_path, tmp / "config.json")
    for extra in ("generation_config.json",):
        if (model_dir / extra).is_file():
            shutil.copyfile(model_dir / extra, tmp / extra)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
