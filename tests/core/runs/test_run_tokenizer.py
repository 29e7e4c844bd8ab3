"""A run's tokenizer through ``tokenizers`` alone gives transformers' ids and text, and the studio's
run path imports neither transformers nor torch for it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import UnsupportedModelError
from core.models.checkpoints import check_weight_headers
from core.runs.generation import load_run_tokenizer, load_tokenizer
from core.runs.run_tokenizer import PlainTokenizer, encode_left_padded

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "resources" / "demo_models" / "demo-llama"
PROMPTS = ["The secret of life is", "You will", "naïve ☃ 日本 — <|eos|> and <|pad|> inside", " two  spaces\n\tand a tab",
           ""]


@pytest.mark.parametrize("model", ["demo-llama", "demo-moe", "demo-llama-draft"])
def test_plain_tokenizer_gives_transformers_ids_mask_and_text(model):
    """The shipped checkpoints, as ``core.models`` writes them (tokenizer saved by transformers)."""
    model_dir = str(DEMO.parent / model)
    plain, reference = load_run_tokenizer(model_dir), load_tokenizer(model_dir)
    assert isinstance(plain, PlainTokenizer)
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[1:3]):
        enc, ref = encode_left_padded(plain, prompts), reference(prompts, padding=True)
        assert enc.input_ids == tuple(map(tuple, ref["input_ids"]))
        assert enc.attention_mask == tuple(map(tuple, ref["attention_mask"]))
    assert (plain.pad_token_id, plain.eos_token_id) == (reference.pad_token_id, reference.eos_token_id)
    ids = [*range(40), reference.eos_token_id, reference.pad_token_id, *range(300, 340)]
    for skip in (True, False):
        assert plain.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_config_that_changes_encoding_goes_to_transformers(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": True}))
    assert not isinstance(load_run_tokenizer(str(tmp_path)), PlainTokenizer)


def test_a_named_special_token_the_vocabulary_does_not_mark_special_goes_to_transformers(tmp_path):
    shutil.copy(DEMO / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tokenizer = json.loads((DEMO / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        token["special"] = token["content"] != "<|eos|>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert not isinstance(load_run_tokenizer(str(tmp_path)), PlainTokenizer)


def test_the_run_path_checks_and_tokenizes_without_importing_transformers_or_torch():
    code = ("import sys\n"
            "from core.runs.generation import check_weight_headers, encode_left_padded, load_run_tokenizer\n"
            f"d = {str(DEMO)!r}\n"
            "check_weight_headers(d)\n"
            "encode_left_padded(load_run_tokenizer(d), ['The secret of life is'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unreadable_weight_files_are_refused_without_torch(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no model.safetensors"):
        check_weight_headers(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(UnsupportedModelError, match="not a readable safetensors file"):
        check_weight_headers(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(UnsupportedModelError, match="invalid index"):
        check_weight_headers(tmp_path)
    check_weight_headers(DEMO)
