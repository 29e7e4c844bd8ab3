"""A run's tokenizer without transformers or torch, where the checkpoint allows it.

Importing transformers (which imports torch) cost the studio 3.9 s of CPU on its first run
(``AutoTokenizer`` 3.9 s, ``tokenizers`` alone 0.06 s: load 10, this host), taken from the
demo's agents while they were being profiled on the same two cores. A checkpoint whose
tokenizer is a plain fast tokenizer (``tokenizer.json`` and a ``tokenizer_config.json`` that
names ``TokenizersBackend`` or ``PreTrainedTokenizerFast`` and sets nothing that changes encoding:
the checkpoints ``core.models`` writes) is read here with the ``tokenizers`` library that
transformers itself runs underneath, so the ids are the same (tests compare them with
``AutoTokenizer``); any other checkpoint gets transformers' tokenizer (``load_tokenizer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.errors import UnsupportedModelError

PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""transformers' fast tokenizer classes that add nothing of their own to ``tokenizer.json``."""
NEUTRAL_KEYS = frozenset({"backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                          "model_max_length", "padding_side", "is_local", "local_files_only"})
"""``tokenizer_config.json`` keys that leave encoding and decoding as ``tokenizer.json`` says
(any other key, e.g. ``add_bos_token``, ``clean_up_tokenization_spaces`` or a chat template,
sends the checkpoint to transformers, which knows what it means)."""


@dataclass(frozen=True)
class Encoded:
    """Prompts as a run sends them: ids padded on the left to one width, and their mask."""

    input_ids: tuple[tuple[int, ...], ...]
    attention_mask: tuple[tuple[int, ...], ...]

    @property
    def width(self) -> int:
        return len(self.input_ids[0]) if self.input_ids else 0


class PlainTokenizer:
    """``tokenizer.json`` through ``tokenizers``: the calls a run makes of a transformers tokenizer
    (``decode``, ``pad_token_id``, ``eos_token_id``) and ``encode_left_padded``."""

    def __init__(self, tokenizer, pad_token_id: int, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id

    def encode_left_padded(self, prompts: list[str] | tuple[str, ...]) -> Encoded:
        rows = [e.ids for e in self._tokenizer.encode_batch(list(prompts), add_special_tokens=True)]
        return _left_padded(rows, self.pad_token_id)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def plain_tokenizer_file(model_dir: str | Path) -> Path | None:
    """``tokenizer.json`` when the checkpoint's tokenizer is a plain fast one (module docstring), else None."""
    path = Path(model_dir)
    config_file, tokenizer_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_CLASSES:
        return None
    if set(config) - NEUTRAL_KEYS or config.get("padding_side", "left") != "left":
        return None
    if not all(isinstance(config.get(k), str) for k in ("bos_token", "eos_token", "pad_token") if k in config):
        return None
    return tokenizer_file


def load_plain_tokenizer(model_dir: str | Path) -> PlainTokenizer | None:
    """The checkpoint's tokenizer through ``tokenizers`` (no transformers, no torch); None when it is
    not a plain fast tokenizer or names special tokens its vocabulary lacks or does not mark special
    (transformers then decides)."""
    file = plain_tokenizer_file(model_dir)
    if file is None:
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except Exception as err:  # noqa: BLE001 — the library raises its own exception types
        raise UnsupportedModelError(f"{model_dir}: cannot load a tokenizer ({err})") from None
    ids = {k: tokenizer.token_to_id(config[k]) for k in ("eos_token", "pad_token") if k in config}
    if any(v is None for v in ids.values()):
        return None
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    named = [tokenizer.token_to_id(config[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
             if k in config]
    if not set(named) <= special:  # transformers would skip them in decoding as special; tokenizers would not
        return None
    eos = ids.get("eos_token")
    pad = ids.get("pad_token", eos)
    if pad is None:
        return None
    return PlainTokenizer(tokenizer, pad, eos)


def encode_left_padded(tokenizer, prompts: list[str] | tuple[str, ...]) -> Encoded:
    """Prompts encoded as one left-padded batch, by a ``PlainTokenizer`` or a transformers tokenizer
    (padding on the left: ``load_tokenizer`` sets it)."""
    if isinstance(tokenizer, PlainTokenizer):
        return tokenizer.encode_left_padded(prompts)
    enc = tokenizer(list(prompts), padding=True)
    return Encoded(tuple(tuple(r) for r in enc["input_ids"]), tuple(tuple(r) for r in enc["attention_mask"]))


def _left_padded(rows: list[list[int]], pad_token_id: int) -> Encoded:
    width = max((len(r) for r in rows), default=0)
    return Encoded(tuple(tuple([pad_token_id] * (width - len(r)) + list(r)) for r in rows),
                   tuple(tuple([0] * (width - len(r)) + [1] * len(r)) for r in rows))


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, padding on the left (prompts end where generation starts)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise UnsupportedModelError(f"{model_dir}: cannot load a tokenizer ({err})") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_run_tokenizer(model_dir: str):
    """The tokenizer a run encodes and decodes with: ``tokenizers`` alone where the checkpoint's is a
    plain fast tokenizer (same ids, no transformers or torch imported: ``load_plain_tokenizer``),
    else ``load_tokenizer``'s."""
    return load_plain_tokenizer(model_dir) or load_tokenizer(model_dir)


__all__ = ["Encoded", "PlainTokenizer", "encode_left_padded", "load_plain_tokenizer", "load_run_tokenizer",
           "load_tokenizer", "plain_tokenizer_file"]
