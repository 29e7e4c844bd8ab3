"""Text pieces streamed while tokens arrive add up to the final text, with no broken characters."""

from __future__ import annotations

import pytest

from core.models.checkpoints import ModelRecipe, make_model
from core.runs.generation import TextPieces, load_tokenizer

TEXT = "naïve ☃ snow 日本 — done"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=1, hidden=32, heads=2, kv_heads=1, vocab=512, seed=5)
    return load_tokenizer(str(make_model(recipe, tmp_path_factory.mktemp("gen") / "m")))


def test_a_character_split_over_tokens_is_streamed_whole_once_its_last_byte_arrives(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    # the case being tested: this byte-level tokenizer splits some characters over several tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces = TextPieces(tokenizer, 1, stop_ids=())
    streamed = [pieces.piece(0, i) for i in ids]
    assert all("\ufffd" not in p for p in streamed), streamed
    assert "".join(streamed) == tokenizer.decode(ids) == TEXT


def test_a_sequence_ending_inside_a_character_still_streams_all_of_its_text(tokenizer):
    ids = tokenizer("snow 日", add_special_tokens=False)["input_ids"][:-1]  # cut inside 日
    full = tokenizer.decode(ids)
    assert full.endswith("\ufffd")
    by_length = TextPieces(tokenizer, 1, stop_ids=(), max_new_tokens=len(ids))
    assert "".join(by_length.piece(0, i) for i in ids) == full
    eos = 99999
    by_stop = TextPieces(tokenizer, 1, stop_ids=(eos,))
    assert "".join(by_stop.piece(0, i) for i in [*ids, eos, 5]) == full
