"""Windowed text pieces add up exactly to the tokenizer's own full decode, on long random token
sequences, for a byte-level BPE (GPT-2/Llama-3 style) and a SentencePiece (Llama-2 style) tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from core.models.checkpoints import corpus_lines, train_tokenizer
from core.runs.text_pieces import TextPieces


def _sentencepiece_tokenizer():
    """transformers' own Llama-2 tokenizer (Metaspace, byte fallback, leading-space strip) over a
    BPE trained on the shipped corpus, with the 256 ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    bpe.train_from_iterator(corpus_lines(), trainer=trainers.BpeTrainer(vocab_size=400, show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    return LlamaTokenizer(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                               for m in model["merges"]])


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece"])
def tokenizer(request):
    return train_tokenizer(512) if request.param == "byte_level_bpe" else _sentencepiece_tokenizer()


def _random_ids(tokenizer, n: int, seed: int) -> list[int]:
    """Random ids over the whole vocabulary, a third of them from the byte-fallback / single-byte
    tokens (so multi-byte characters are split and broken) and some special tokens."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    specials = list(tokenizer.all_special_ids)
    first_bytes = list(range(3, 259))  # the <0xNN> ids (sentencepiece); low-rank single bytes (byte-level)
    ids = []
    for _ in range(n):
        r = rng.random()
        ids.append(rng.choice(specials) if r < 0.03 else rng.choice(first_bytes) if r < 0.35 else rng.randrange(vocab))
    return ids


def test_the_kind_of_tokenizer_is_the_one_meant(tokenizer):
    text = "naïve ☃ snow 日本"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character is split over tokens


@pytest.mark.parametrize("seed", range(4))
def test_the_pieces_of_a_long_random_sequence_add_up_to_its_full_decode(tokenizer, seed):
    ids = _random_ids(tokenizer, 2000, seed)
    pieces = TextPieces(tokenizer, 1, stop_ids=(), max_new_tokens=len(ids))  # the last token flushes
    streamed = [pieces.piece(0, i) for i in ids]
    assert "".join(streamed) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_character_split_over_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer("the cat — 日本 ☃, naïve", add_special_tokens=False)["input_ids"]
    pieces = TextPieces(tokenizer, 1, stop_ids=())
    emitted = ""
    for k, i in enumerate(ids, 1):
        emitted += pieces.piece(0, i)
        assert tokenizer.decode(ids[:k]).startswith(emitted) and "\ufffd" not in emitted
    assert emitted == tokenizer.decode(ids)


def test_a_stop_token_ends_the_text_and_max_new_tokens_ends_it_with_that_token(tokenizer):
    ids = _random_ids(tokenizer, 300, 9)
    eos = tokenizer.eos_token_id
    ids = [i for i in ids if i != eos]
    by_stop = TextPieces(tokenizer, 2, stop_ids=(eos,))
    text = "".join(by_stop.piece(1, i) for i in [*ids, eos, 7, 8])
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert by_stop.finished == [False, True]
    by_length = TextPieces(tokenizer, 1, stop_ids=(eos,), max_new_tokens=100)
    assert "".join(by_length.piece(0, i) for i in ids) == tokenizer.decode(ids[:100], skip_special_tokens=True)


def test_an_ignored_stop_token_is_left_out_and_the_text_goes_on(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    pieces = TextPieces(tokenizer, 1, stop_ids=(eos,), stop_ends=False)
    text = "".join(pieces.piece(0, i) for i in [*ids[:2], eos, *ids[2:]])
    assert text == tokenizer.decode(ids) and not pieces.finished[0]


@pytest.fixture(scope="module")
def cleaning_tokenizer(tmp_path_factory):
    """A BERT-style WordPiece tokenizer with ``clean_up_tokenization_spaces=True``, written into a folder
    and loaded back by ``AutoTokenizer`` as a checkpoint's is."""
    from transformers import AutoTokenizer

    from core.models.checkpoints import train_wordpiece_tokenizer

    folder = tmp_path_factory.mktemp("wordpiece")
    train_wordpiece_tokenizer(512).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def _ids_the_clean_up_rewrites(tokenizer, n: int, seed: int) -> list[int]:
    """Random ids, half of them the pieces transformers' clean-up joins (" ' s", " n ' t", " ."), some special."""
    rng = random.Random(seed)
    joined = tokenizer.convert_tokens_to_ids(["'", "s", "t", "m", "re", "ve", "n", "##n", ".", ",", "?", "!"])
    specials = list(tokenizer.all_special_ids)
    ids = []
    for _ in range(n):
        r = rng.random()
        ids.append(rng.choice(specials) if r < 0.03 else rng.choice(joined) if r < 0.5 else rng.randrange(len(tokenizer)))
    return ids


def test_the_cleaning_tokenizer_cleans_spaces_over_the_whole_text(cleaning_tokenizer):
    ids = cleaning_tokenizer("the cat ' s here , isn ' t it", add_special_tokens=False)["input_ids"]
    assert cleaning_tokenizer.decode(ids) == "the cat's here, isn't it"
    assert cleaning_tokenizer.decode(ids, clean_up_tokenization_spaces=False) == "the cat ' s here, isn ' t it"


@pytest.mark.parametrize("seed", range(4))
def test_the_pieces_of_a_sequence_add_up_to_the_full_decode_of_a_tokenizer_that_cleans_up_spaces(
        cleaning_tokenizer, seed):
    ids = _ids_the_clean_up_rewrites(cleaning_tokenizer, 2000, seed)
    pieces = TextPieces(cleaning_tokenizer, 1, stop_ids=(), max_new_tokens=len(ids))
    assert "".join(pieces.piece(0, i) for i in ids) == cleaning_tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_token_lets_out_the_text_held_for_the_clean_up(cleaning_tokenizer):
    eos = cleaning_tokenizer.eos_token_id
    ids = cleaning_tokenizer("you ' re ' ok", add_special_tokens=False)["input_ids"]
    pieces = TextPieces(cleaning_tokenizer, 1, stop_ids=(eos,))
    streamed = "".join(pieces.piece(0, i) for i in ids)
    full = cleaning_tokenizer.decode(ids)
    assert full == "you're'ok" and full.startswith(streamed) and streamed != full  # " ' ok" + "s" would differ
    assert streamed + pieces.piece(0, eos) == full


@pytest.mark.parametrize("forced", [False, True], ids=["flag-ignored-for-bpe", "forced"])
def test_a_byte_level_bpe_with_the_clean_up_flag_streams_its_full_decode(forced):
    """transformers ignores ``clean_up_tokenization_spaces`` for a BPE model unless forced (it would corrupt
    GPT-2-style text); the pieces follow whichever its decode does."""
    tokenizer = train_tokenizer(512)
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = forced
    ids = tokenizer(" ".join(["the cat ' s here , isn ' t it ?"] * 40), add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert (full != tokenizer.decode(ids, clean_up_tokenization_spaces=False)) == forced
    pieces = TextPieces(tokenizer, 1, stop_ids=(), max_new_tokens=len(ids))
    assert "".join(pieces.piece(0, i) for i in ids) == full
