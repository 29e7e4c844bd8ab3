"""Streaming text pieces: CPU per token of ``core.runs.text_pieces.TextPieces`` at 32, 512 and 2,000
tokens; prints one JSON line.

The text: the shipped corpus, encoded by the project's byte-level BPE (``train_tokenizer(4096)``,
the demo's vocabulary), its first n ids streamed through ``piece`` one by one (a sequence of n new
tokens, as ``edgeshard serve`` / ``run`` and the Run screen stream one). ``us_per_token``: the median
over ``--rounds`` of the sequence's CPU time (``time.thread_time``) over n, µs. With ``--baseline
TREE``: that checkout's TextPieces runs the same sequences in the same
rounds (alternating): ``baseline_us_per_token`` and ``speedup`` (baseline / this). Both trees' pieces
are checked to add up to the tokenizer's full decode. ``cleaning``: the same for a BERT-style WordPiece
tokenizer whose decode cleans up spaces (``train_wordpiece_tokenizer(4096)``, the corpus lowercased by
its normalizer); only this tree's pieces are checked there (a baseline before the clean-up was streamed
gets a different text). The 1-minute load is reported before and after.
Usage: python bench/text_pieces.py [--rounds 5] [--baseline OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.models.checkpoints import corpus_lines, train_tokenizer, train_wordpiece_tokenizer  # noqa: E402
from core.runs.text_pieces import TextPieces  # noqa: E402

LENGTHS = (32, 512, 2000)


def _baseline_class(tree: str):
    """The tree's own TextPieces: its ``core/runs/text_pieces.py`` (loaded from the file: importing the
    tree's ``generation.py`` would take this tree's ``core.runs.text_pieces``), or an older tree's
    ``core/runs/generation.py``."""
    path = os.path.join(tree, "core/runs/text_pieces.py")
    if not os.path.exists(path):
        path = os.path.join(tree, "core/runs/generation.py")
    spec = importlib.util.spec_from_file_location("baseline_text_pieces", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.TextPieces


def _cpu_per_token(cls, tokenizer, ids: list[int], full: str | None) -> float:
    pieces = cls(tokenizer, 1, (), max_new_tokens=len(ids))
    started = time.thread_time()
    text = "".join(pieces.piece(0, i) for i in ids)
    spent = time.thread_time() - started
    assert full is None or text == full, "pieces do not add up to the full decode"
    return spent / len(ids) * 1e6


def _figures(kinds: dict, tokenizer, rounds: int, checked: set[str]) -> dict:
    """us/token per length for ``kinds`` over the corpus's ids, rounds alternating their order."""
    tokenizer.model_max_length = 1 << 30  # the whole corpus is encoded once (no model sees it)
    ids = tokenizer(" ".join(corpus_lines()), add_special_tokens=False)["input_ids"]
    assert len(ids) >= max(LENGTHS), len(ids)
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in LENGTHS} for k in kinds}
    for r in range(rounds):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for n in LENGTHS:
            full = tokenizer.decode(ids[:n], skip_special_tokens=True)
            for kind in order:
                times[kind][n].append(_cpu_per_token(kinds[kind], tokenizer, ids[:n], full if kind in checked else None))
    out = {"us_per_token": {n: round(statistics.median(times["this"][n]), 1) for n in LENGTHS}}
    if "baseline" in kinds:
        base = {n: statistics.median(times["baseline"][n]) for n in LENGTHS}
        out["baseline_us_per_token"] = {n: round(base[n], 1) for n in LENGTHS}
        out["speedup"] = {n: round(base[n] / statistics.median(times["this"][n]), 2) for n in LENGTHS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a checkout whose TextPieces to compare")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    kinds = {"this": TextPieces}
    if args.baseline:
        kinds["baseline"] = _baseline_class(args.baseline)
    out = _figures(kinds, train_tokenizer(4096), args.rounds, checked=set(kinds))
    out["cleaning"] = _figures(kinds, train_wordpiece_tokenizer(4096), args.rounds, checked={"this"})
    out["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
