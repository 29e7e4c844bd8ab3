"""Streamed text follows each micro-batch's step order, whichever agent's report arrives first
(staggered replicas sample a batch's steps in turn, over their own connections)."""

from __future__ import annotations

from agents.protocol import TokenEvent
from core.runs.generation import TextPieces, _TextSink


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class _Collect:
    def __init__(self):
        self.tokens = []

    def on_event(self, event):
        pass

    def on_tokens(self, tokens):
        self.tokens.append(tokens)


def _tokens(mb, step, token):
    return TokenEvent(micro_batch=mb, step=step, sequence_ids=(mb,), token_ids=(token,), t_s=float(step))


def test_a_step_that_overtakes_the_one_before_waits_for_it():
    out = _Collect()
    sink = _TextSink(out, TextPieces(_Tokenizer(), 2, ()))
    for mb, step, token in ((0, 0, 0), (0, 2, 2), (1, 0, 5), (0, 1, 1), (1, 1, 6)):
        sink.on_tokens(_tokens(mb, step, token))
    assert [(t.micro_batch, t.step, t.text) for t in out.tokens] == [
        (0, 0, ("a",)), (1, 0, ("f",)), (0, 1, ("b",)), (0, 2, ("c",)), (1, 1, ("g",))]


def test_what_is_held_when_the_run_ends_goes_on_in_step_order():
    out = _Collect()
    sink = _TextSink(out, TextPieces(_Tokenizer(), 1, ()))
    sink.on_tokens(_tokens(0, 3, 3))
    sink.on_tokens(_tokens(0, 1, 1))
    assert out.tokens == []
    sink.flush()
    assert [(t.step, t.text) for t in out.tokens] == [(1, ("b",)), (3, ("d",))]
