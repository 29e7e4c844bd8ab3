"""Per sequence, the text each new token adds, decoding only a short window of tokens."""

from __future__ import annotations

import functools
import weakref

_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _list_decode(tokenizer):
    """``tokenizer.decode`` for a list of ints. transformers' own ``decode`` first converts its ids (an
    ``isinstance`` per id: O(n) Python for each piece, ~half of a 32-token request's decode), then calls
    ``_decode``, which a list of ints needs no conversion for: where ``decode`` is the base class's, ``_decode``
    is the same call. A tokenizer with its own ``decode`` keeps it."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if getattr(type(tokenizer), "decode", None) is PreTrainedTokenizerBase.decode and hasattr(tokenizer, "_decode"):
        return tokenizer._decode
    return tokenizer.decode


def _cleans_up_spaces(tokenizer) -> bool:
    """Whether ``decode`` runs ``clean_up_tokenization`` over the whole text (" ' s" -> "'s"), as
    transformers' ``_decode`` decides it: the tokenizer's flag, except for a BPE model (where it
    would corrupt the text) unless forced."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False) or not hasattr(tokenizer, "clean_up_tokenization"):
        return False
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    return type(model).__name__ != "BPE" or bool(
        getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))


def _decoding_facts(tokenizer) -> tuple[frozenset[int], frozenset[int], bool]:
    """(ids ``skip_special_tokens`` leaves out, byte-fallback ids ``<0xNN>``, whether decode cleans up
    spaces), once per tokenizer: asked per request they would cost more than the request's decoding."""
    try:
        return _FACTS[tokenizer]
    except (KeyError, TypeError):
        pass
    skipped = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    byte_ids: frozenset[int] = frozenset()
    if getattr(model, "byte_fallback", False):
        ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
        byte_ids = frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)
    facts = (skipped, byte_ids, _cleans_up_spaces(tokenizer))
    try:
        _FACTS[tokenizer] = facts
    except TypeError:
        pass
    return facts


CLEANUP_REACH = 3
"""transformers' ``clean_up_tokenization`` rewrites only a space and the at most 3 characters after it
(" n't", " 's", " ' "...), and only deletes spaces: text whose last 3 characters hold no space is
cleaned the same alone as followed by anything, so it may go out."""


class TextPieces:
    """Per sequence, the text each new token adds.

    Decoding the whole sequence for every token costs O(n) a token (O(n^2) an answer), so it
    decodes a window the way well-known servers do: the tokens since ``prefix`` against those
    since ``prefix`` up to ``read`` (the tokens already emitted), emitting the difference; the
    window still begins before the new tokens, so tokenizers that merge pieces (leading spaces,
    byte fallback) come out right. A character whose bytes are split over tokens decodes to
    U+FFFD until its last byte arrives, so the offsets stay put, that tail is held back and is
    emitted whole with the token that completes it (or, never completed, when the sequence ends:
    at a stop token or after ``max_new_tokens``). The offsets move only when the window's text
    grew, so the window never begins with nothing but skipped special tokens (it would decode as
    the start of a text: SentencePiece strips the leading space there).
    SentencePiece's byte fallback decodes a whole run of byte tokens at once (one invalid byte
    turns the run's every byte into U+FFFD), so a run is held until a token that is not a byte
    (or the end) closes it.
    A tokenizer whose ``decode`` cleans up spaces over the whole text (``clean_up_tokenization_spaces``,
    e.g. BERT-style WordPiece: " ' s" -> "'s") would make a text streamed window by window differ
    from the whole decode, so its windows are decoded uncleaned and the clean-up runs over the
    stream: text within ``CLEANUP_REACH`` after a space is held until what follows decides it.
    So the pieces of a sequence add up to ``decode(ids, skip_special_tokens=True)`` of all its
    tokens, for the byte-level BPE, SentencePiece and WordPiece decoders of transformers.
    """

    def __init__(self, tokenizer, n: int, stop_ids: tuple[int, ...], max_new_tokens: int | None = None,
                 stop_ends: bool = True) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.stop = set(stop_ids)
        self.stop_ends = stop_ends
        self._skipped, self._bytes, cleans = _decoding_facts(tokenizer)
        self._decode = _list_decode(tokenizer)
        self._clean_up = tokenizer.clean_up_tokenization if cleans else None
        if cleans:  # windows decoded uncleaned; the stream is cleaned (_cleaned)
            self._decode = functools.partial(self._decode, clean_up_tokenization_spaces=False)
        self._unclean = [""] * n
        """Per sequence, decoded text held back uncleaned: a clean-up could still change it."""
        self._prefix = [0] * n
        """Where each sequence's window starts: its text before is emitted and no longer decoded."""
        self._read = [0] * n
        """How many of each sequence's tokens are emitted (their text complete)."""

    def piece(self, seq: int, token: int) -> str:
        if self.finished[seq]:
            return ""
        if token in self.stop:
            if not self.stop_ends:  # EOS ignored (presenter pace): left out of the text, the run goes on
                return ""
            self.finished[seq] = True
            return self._rest(seq)
        ids = self.ids[seq]
        ids.append(token)
        if self.max_new_tokens is not None and len(ids) >= self.max_new_tokens:
            self.finished[seq] = True
            return self._rest(seq)
        if self._bytes and self._in_byte_run(ids):
            return ""
        prefix, read = self._prefix[seq], self._read[seq]
        done = self._decode(ids[prefix:read], skip_special_tokens=True)
        text = self._decode(ids[prefix:], skip_special_tokens=True)
        if text.endswith("\ufffd") or len(text) <= len(done):  # a character not complete yet: held
            return ""
        self._prefix[seq] = read
        self._read[seq] = len(ids)
        return self._out(seq, text[len(done):], ended=False)

    def _out(self, seq: int, added: str, ended: bool) -> str:
        """``added`` as it goes out: as decoded, or through the stream's clean-up."""
        return added if self._clean_up is None else self._cleaned(seq, added, ended)

    def _cleaned(self, seq: int, added: str, ended: bool) -> str:
        """The held text and ``added``, cleaned up to where no later text can change the clean-up
        (all of it once the sequence ended); the rest held."""
        held = self._unclean[seq] + added
        cut = len(held)
        while not ended and (space := held.rfind(" ", max(0, cut - CLEANUP_REACH), cut)) >= 0:
            cut = space
        self._unclean[seq] = held[cut:]
        return self._clean_up(held[:cut]) if cut else ""

    def _in_byte_run(self, ids: list[int]) -> bool:
        """Whether the last token that decodes to anything is a byte-fallback token."""
        for i in reversed(ids):
            if i not in self._skipped:
                return i in self._bytes
        return False

    def _rest(self, seq: int) -> str:
        """Everything not emitted yet (an incomplete character included): the sequence ended."""
        ids, prefix, read = self.ids[seq], self._prefix[seq], self._read[seq]
        done = self._decode(ids[prefix:read], skip_special_tokens=True)
        text = self._decode(ids[prefix:], skip_special_tokens=True)
        self._prefix[seq] = self._read[seq] = len(ids)
        return self._out(seq, text[len(done):], ended=True)
