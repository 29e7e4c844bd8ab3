"""Train a small checkpoint briefly on English text, so a demo's generations read as phrases.

A random-weight model babbles, which hides what a demo shows. Weights cannot be
downloaded here, but text can come from the distribution: Debian's ``fortunes`` package
(BSD-licensed fortune-mod data: quotations, proverbs, literature excerpts) installs plain
``%``-separated files under ``/usr/share/games/fortunes`` (scripts/install-system-deps.sh).
``fortune_lines`` keeps the quotations that read as plain prose (attributions, dialogue,
verse, code and shouting dropped: a small model imitates whatever it sees, and names
after ``--`` are what it learns first). ``train_model`` trains a byte-level BPE tokenizer on
that text (same code as ``checkpoints.train_tokenizer``) and the recipe's model on it, then
writes an ordinary HF checkpoint. The recipe is the caller's, so a trained and an untrained
checkpoint of one recipe have the same units and sizes: a profile or plan made for one holds
for the other.

Training is bounded by steps and by time, whichever ends first, and the learning rate
decays on that same progress, so a slow or busy machine still ends with a decayed (usable)
model within the budget. Measured on the demo recipe (6 layers, hidden 128, vocab 4096):
~830 steps in 150 s on 2 pinned cores of an otherwise busy 16-core Xeon give greedy text such
as "Love is the best policy." and "You will be successful."; a larger model (hidden 192) gets
~490 steps in the same time and loops ("a man who has been a man who has been ..."). On a
2-core machine at load ~15 the same budget gave 7 steps (two torch threads starved): the
checkpoint is still written, decayed, but reads as fragments. On a 2-core machine shared with
other work (niced, as the studio runs it): 34 steps at load 5-6 (answers "."), 356 at load 2-4;
after 494 steps in all "The secret of life is to be." and "You will be a good for you." (loss
4.63 on the text), after 713 "You will be a man of the world." (loss 3.85; bench/demo_text.py).

``train_in_subprocess`` runs it in a child process (``python -m core.models.training``) so
a GUI stays live and the work can be cancelled; the child reports progress as lines on
stdout, which the parent forwards to its reporter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from core.errors import FormatError
from core.models.checkpoints import ModelRecipe, build_config, train_tokenizer
from core.reporting import Cancelled, NullReporter, Reporter

FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNE_FILES = ("wisdom", "literature", "fortunes", "platitudes", "love", "education", "work", "art", "food",
                 "kids", "pets", "people", "humorists", "miscellaneous", "science")
"""The quotation files used (no computer jargon, no offensive set, no verse layouts)."""

PROGRESS_PREFIX = "EDGESHARD-TRAIN"


@dataclass(frozen=True)
class TrainingSettings:
    steps: int = 1500
    """An upper bound: on 2 free cores the time budget ends training first (~830 steps)."""
    batch: int = 32
    seq_len: int = 48
    """Tokens per window; a quotation is ~20 tokens, so a window spans two or three."""
    learning_rate: float = 3e-3
    seed: int = 0
    threads: int = 2
    niceness: int = 10
    """``train_in_subprocess``'s child lowers its priority by this much: it uses the cores the
    studio and its agents leave (a first launch profiles and runs beside the training)."""
    max_seconds: float = 150.0
    """The time budget of the training loop (the tokenizer and saving add a few seconds):
    training ends here even on a loaded machine, with the learning rate decayed
    (``schedule_progress``); ``training.json`` records the steps done."""


_ATTRIBUTION = re.compile(r"\s*(--|~~)\s*[^-]*$")
"""A trailing "-- Author, Work" (the last dash pair to the end)."""
_NOT_PROSE = re.compile(r"[_|<>\[\]{}#@*^~=/\\+%$&;:()]|\d|\.\.|!!|\?\?|''|``")
"""Markup, code, dialogue ("Q:"), numbers, ellipses and emphasis: not plain sentences."""
_SENTENCE_END = re.compile(r"""[.!?]["']?$""")


def prose_quotation(entry: str) -> str | None:
    """One fortune as a plain-prose line (whitespace joined, attribution removed), or None
    when it is not plain prose: non-ASCII, too short or long, not a capitalised sentence,
    unbalanced quotes, markup, numbers, or mostly capitals."""
    text = _ATTRIBUTION.sub("", " ".join(entry.split())).strip()
    if text.startswith('"') and text.endswith('"') and text.count('"') == 2:
        text = text[1:-1].strip()
    if not (20 <= len(text) <= 200 and text.isascii()):
        return None
    if _NOT_PROSE.search(text) or not text[0].isupper() or not _SENTENCE_END.search(text) or text.count('"') % 2:
        return None
    letters = [c for c in text if c.isalpha()]
    if sum(c.isupper() for c in letters) > 0.2 * len(letters):
        return None
    return text


def fortune_lines(root: Path = FORTUNES_DIR, files: tuple[str, ...] = FORTUNE_FILES) -> list[str]:
    """One line per plain-prose quotation (``prose_quotation``) from the ``fortunes`` package's files."""
    present = [root / f for f in files if (root / f).is_file()]
    if not present:
        raise FormatError(str(root), "no fortune files to train on; install the Debian package `fortunes` "
                          "(scripts/install-system-deps.sh does)")
    lines = []
    for path in present:
        for entry in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = prose_quotation(entry)
            if text is not None:
                lines.append(text)
    return lines


def held_out_split(lines: list[str], every: int = 10) -> tuple[list[str], list[str]]:
    """(training lines, held-out lines): every ``every``-th line is held out, and a held-out line whose
    text also occurs among the training lines is dropped, so the two never share a quotation (the
    accuracy of a model trained on the first is measured on the second)."""
    if every < 2:
        raise ValueError(f"every must be >= 2 (got {every})")
    train = [line for i, line in enumerate(lines) if i % every != every - 1]
    seen = set(train)
    held = [line for i, line in enumerate(lines) if i % every == every - 1 and line not in seen]
    return train, held


def schedule_progress(step: int, settings: TrainingSettings, elapsed_s: float) -> float:
    """How far training is, in [0, 1]: by steps or by time, whichever is further. On a slow or
    busy machine the time budget ends the run, and the learning rate has decayed by then
    (a step-only schedule cut short leaves the model at a high learning rate, half trained)."""
    return max(step / max(1, settings.steps), elapsed_s / settings.max_seconds if settings.max_seconds > 0 else 0.0)


def learning_rate_factor(step: int, warmup: int, progress: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 to 0.1 over ``progress``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def optimizer_step(opt, loss, parameters) -> float:
    """One step of every recipe here: gradients of ``loss``, clipped to norm 1, applied; the loss's value."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    opt.step()
    return float(loss.detach())


def token_stream(tokenizer, lines: list[str]):
    """``lines`` as one int64 tensor of token ids, each line closed by the end-of-sequence token:
    the text every recipe here draws its training windows from."""
    import torch

    ids: list[int] = []
    for text in lines:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def run_steps(parameters, settings: TrainingSettings, reporter: Reporter, batch_loss,
              describe=lambda loss: f"loss {loss:.2f}", log_every: int = 10) -> tuple[int, float]:
    """The loop every recipe here shares; ``batch_loss()`` is the recipe's own loss on its next batch.

    AdamW, a warm-up then a cosine by steps or time, whichever is further (``schedule_progress``),
    a cancel between steps, gradients clipped (``optimizer_step``); the bar moves every step (a
    busy machine takes seconds per step), the log every ``log_every`` steps. Returns the steps
    done and the last loss."""
    import torch

    parameters = list(parameters)
    opt = torch.optim.AdamW(parameters, lr=settings.learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, min(settings.steps // 20, 50))
    started = time.perf_counter()
    done, loss_value = 0, float("nan")
    for step in range(settings.steps):
        if reporter.cancel_requested():
            raise Cancelled()
        progress = schedule_progress(step, settings, time.perf_counter() - started)
        if progress >= 1.0:
            reporter.status(f"time budget reached after {step} of {settings.steps} steps")
            break
        for group in opt.param_groups:
            group["lr"] = settings.learning_rate * learning_rate_factor(step, warmup, progress)
        loss_value = optimizer_step(opt, batch_loss(), parameters)
        done = step + 1
        shown = max(done, schedule_progress(done, settings, time.perf_counter() - started) * settings.steps)
        reporter.progress(min(shown, settings.steps), settings.steps)
        if done % log_every == 0 or done == settings.steps:
            reporter.status(f"step {done}/{settings.steps}, {describe(loss_value)}")
    return done, loss_value


def _batches(ids, settings: TrainingSettings, generator):
    import torch

    n = ids.numel() - settings.seq_len
    starts = torch.randint(0, n, (settings.batch,), generator=generator)
    return torch.stack([ids[s: s + settings.seq_len] for s in starts.tolist()])


def trained_steps(model_dir: str | Path) -> int:
    """Optimizer steps recorded in ``model_dir``'s training.json (0: none, or not ours)."""
    try:
        return max(0, int(json.loads((Path(model_dir) / "training.json").read_text())["steps"]))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def train_model(recipe: ModelRecipe, lines: list[str], out_dir: str | Path, reporter: Reporter | None = None,
                settings: TrainingSettings = TrainingSettings(), resume: bool = False) -> Path:
    """Tokenizer + model trained on ``lines``, written to ``out_dir`` (an HF checkpoint).

    ``resume``: continue from the checkpoint already in ``out_dir`` (its weights and tokenizer,
    another budget of steps with a fresh warm-up and decay), so a first training cut short by a
    busy machine is improved at the next launch instead of being kept as it is."""
    import torch
    import transformers

    reporter = reporter or NullReporter()
    r = recipe.resolved()
    out = Path(out_dir)
    prior_steps = trained_steps(out) if resume else 0
    if prior_steps:
        reporter.status(f"continuing the training of {out} after its {prior_steps} steps")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    else:
        reporter.status("training the tokenizer on the text")
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
            tokenizer = train_tokenizer(r.vocab, Path(tmp))
    data = token_stream(tokenizer, lines)
    torch.set_num_threads(max(1, settings.threads))
    if prior_steps:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(r.seed)
            model = transformers.AutoModelForCausalLM.from_config(build_config(r))
    model.train()
    gen = torch.Generator().manual_seed(settings.seed + prior_steps)  # resumed: other windows of the text
    started = time.perf_counter()
    reporter.status(f"training {sum(p.numel() for p in model.parameters()):,} parameters on {data.numel():,} tokens")

    def batch_loss():
        x = _batches(data, settings, gen)
        return model(input_ids=x, labels=x).loss  # HF shifts the labels: each position predicts the next token

    done, loss_value = run_steps(model.parameters(), settings, reporter, batch_loss)
    model.eval()
    dtype = getattr(torch, r.dtype)
    model = model.to(dtype)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                            do_sample=False)
    tmp_out = Path(tempfile.mkdtemp(prefix=".training-", dir=_mkdir(out.parent)))
    try:
        transformers.utils.logging.disable_progress_bar()
        model.save_pretrained(str(tmp_out))
        tokenizer.save_pretrained(str(tmp_out))
        (tmp_out / "training.json").write_text(json.dumps(
            {"text": "Debian fortunes, plain-prose quotations: " + ", ".join(FORTUNE_FILES), "steps": prior_steps + done, "loss": round(loss_value, 3),
             "seconds": round(time.perf_counter() - started, 1), "recipe": r.__dict__}, indent=2))
        with terminate_after():  # a cancel here (the studio quitting) must not leave no checkpoint
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp_out, out)
    finally:
        shutil.rmtree(tmp_out, ignore_errors=True)
    reporter.progress(settings.steps, settings.steps)
    return out


@contextlib.contextmanager
def terminate_after():
    """A SIGTERM arriving inside this block ends the process right after it, not in it.

    A cancel (``train_in_subprocess``) terminates the training process at once: the step in
    flight is abandoned, never awaited (the default SIGTERM action ends the process whatever
    thread, torch's included, is running). Only the checkpoint's replacement (a removal and a
    rename, milliseconds) is shielded, so the checkpoint kept before stays whole or the new one
    is in its place. Outside the main thread (tests) the block is not shielded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if got:
            sys.stdout.flush()
            os._exit(128 + signal.SIGTERM)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


class _LineReporter(NullReporter):
    """The child's reporter: one parseable line per report, read by ``train_in_subprocess``."""

    def status(self, text: str) -> None:
        print(f"{PROGRESS_PREFIX} status {text}", flush=True)

    def progress(self, done: float, total: float) -> None:
        print(f"{PROGRESS_PREFIX} progress {done} {total}", flush=True)


def train_in_subprocess(reporter: Reporter, recipe: ModelRecipe, out_dir: str | Path,
                        settings: TrainingSettings = TrainingSettings(), text_dir: Path = FORTUNES_DIR,
                        resume: bool = False) -> Path:
    """``train_model`` in a child process; progress to ``reporter``; cancel stops the child."""
    fortune_lines(text_dir)  # a missing text is the caller's clear error, before any process starts
    args = [sys.executable, "-m", "core.models.training", "--out", str(out_dir), "--text-dir", str(text_dir),
            "--recipe", json.dumps(recipe.__dict__), "--settings", json.dumps(settings.__dict__)]
    if resume:
        args.append("--resume")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    ended = threading.Event()

    def kill_when_cancelled() -> None:  # a cancel (e.g. the studio quitting) must not wait for the next line
        while not ended.wait(0.05):
            if reporter.cancel_requested():
                # SIGTERM ends the process at once (the step in flight is abandoned), except while it
                # replaces the checkpoint (``terminate_after``): then right after, never leaving none
                proc.terminate()
                return

    threading.Thread(target=kill_when_cancelled, name="training-cancel", daemon=True).start()
    tail: list[str] = []
    try:
        for line in proc.stdout:
            if line.startswith(PROGRESS_PREFIX):
                _, kind, rest = line.rstrip("\n").split(" ", 2)
                if kind == "progress":
                    done, total = rest.split()
                    reporter.progress(float(done), float(total))
                else:
                    reporter.status(rest)
            else:
                tail = (tail + [line.rstrip()])[-20:]
        code = proc.wait()
        if reporter.cancel_requested():
            raise Cancelled()
    finally:
        ended.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if code != 0:
        raise FormatError("training", f"the training process failed (exit {code}): " + " | ".join(tail[-5:]))
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m core.models.training")
    p.add_argument("--out", required=True)
    p.add_argument("--text-dir", default=str(FORTUNES_DIR))
    p.add_argument("--recipe", required=True, help="ModelRecipe fields as JSON")
    p.add_argument("--settings", default="{}", help="TrainingSettings fields as JSON")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    a = p.parse_args(argv)
    recipe = ModelRecipe(**json.loads(a.recipe))
    settings = TrainingSettings(**json.loads(a.settings))
    if settings.niceness and hasattr(os, "nice"):
        # yield the cores to the studio and its agents: a first launch profiles and runs while this
        # trains, and a profile measured beside a full-speed training is slow and noisy
        os.nice(settings.niceness)
    train_model(recipe, fortune_lines(Path(a.text_dir)), a.out, _LineReporter(), settings, resume=a.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
