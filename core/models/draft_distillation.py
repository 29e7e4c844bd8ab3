"""A speculative-decoding draft distilled from its target: a 1-2-block copy of the target's ends,
trained to predict the target's next-token distribution.

Why distilled and not trained on the text like the target: a draft is worth what it agrees with
the target, not what it knows of the text. A draft trained on the text with the demo's recipe
agreed with the demo model on 34 % of its proposals (bench/speculative.py); one that starts from
the target's embedding, first block(s), final norm and head, and learns the target's soft
distribution (KL) over the text *and over the target's own greedy continuations* (what it will
be asked to guess while decoding) agrees far more often for the same cost.

``measured_acceptance`` is the per-token acceptance rate alpha on held-out text (the target's
greedy continuations of held-out lines' openings, teacher-forced: how often the draft's greedy
token is the target's). It is stored with the draft (``speculation.json``), where the cost
model reads it (``stored_acceptance``).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

from core.models.training import TrainingSettings, held_out_split, run_steps, token_stream
from core.reporting import NullReporter, Reporter

SPECULATION_FILE = "speculation.json"
"""Beside a draft's weights: its measured acceptance rate against its target."""

OPENING_TOKENS = 4
"""A continuation starts from a line's first tokens (the bench's prompts are 3-5 tokens)."""


def draft_of(target, layers: int):
    """A ``layers``-block model of ``target``'s kind with its embedding, norm and head and its
    first ``layers - 1`` blocks and last block (a good start: the draft then already predicts what
    the target would say after a shallow read)."""
    config = copy.deepcopy(target.config)
    n = config.num_hidden_layers
    if not 1 <= layers < n:
        raise ValueError(f"a draft has 1..{n - 1} blocks, got {layers}")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = type(target)(config)
    picks = [*range(layers - 1), n - 1]
    state = target.state_dict()
    own = {}
    for key in draft.state_dict():
        parts = key.split(".")
        if "layers" in parts:
            i = parts.index("layers") + 1
            parts[i] = str(picks[int(parts[i])])
        own[key] = state[".".join(parts)].clone()
    draft.load_state_dict(own)
    return draft


def greedy_continuations(target, openings: list[list[int]], tokens: int, batch: int = 256):
    """The target's greedy continuation of each opening (all of one length), ``tokens`` long, no stop."""
    import torch

    out = []
    with torch.inference_mode():
        for s in range(0, len(openings), batch):
            ids = torch.tensor(openings[s: s + batch])
            out.append(target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                       min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0))
    return torch.cat(out)


def openings_of(tokenizer, lines: list[str]) -> list[list[int]]:
    return [ids[:OPENING_TOKENS] for ids in (tokenizer(t, add_special_tokens=False)["input_ids"] for t in lines)
            if len(ids) >= OPENING_TOKENS]


def measured_acceptance(target, draft, sequences) -> float:
    """Per-token acceptance alpha: of the positions after each sequence's opening, the share where
    the draft's greedy token equals the target's (teacher-forced on the target's own text)."""
    import torch

    with torch.inference_mode():
        t = target(input_ids=sequences).logits[:, OPENING_TOKENS - 1:-1].argmax(-1)
        d = draft(input_ids=sequences).logits[:, OPENING_TOKENS - 1:-1].argmax(-1)
    return float((t == d).float().mean())


def stored_acceptance(draft_dir: str | Path) -> float | None:
    """The acceptance rate stored with a draft (None: not measured)."""
    try:
        return float(json.loads((Path(draft_dir) / SPECULATION_FILE).read_text())["acceptance_rate"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def distill_draft(target_dir: str | Path, lines: list[str], out_dir: str | Path, layers: int = 1,
                  reporter: Reporter | None = None, settings: TrainingSettings = TrainingSettings(),
                  continuation_tokens: int = 44, openings: int = 1536) -> Path:
    """A ``layers``-block draft of the checkpoint at ``target_dir`` distilled on ``lines`` (their
    training part, ``held_out_split``), written to ``out_dir`` with the target's tokenizer and its
    held-out acceptance rate (``speculation.json``). ``openings``: how many training lines' openings
    the target continues (its continuations are half of every batch)."""
    import torch
    import torch.nn.functional as F
    import transformers

    reporter = reporter or NullReporter()
    torch.set_num_threads(max(1, settings.threads))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(target_dir))
    target = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    train_lines, held_lines = held_out_split(lines)
    reporter.status("the target's greedy continuations of the text's openings")
    continued = greedy_continuations(target, openings_of(tokenizer, train_lines)[:openings], continuation_tokens)
    held = greedy_continuations(target, openings_of(tokenizer, held_lines), continuation_tokens)
    text = token_stream(tokenizer, train_lines)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        draft = draft_of(target, layers)
    draft.train()
    gen = torch.Generator().manual_seed(settings.seed)
    started = time.perf_counter()
    half = settings.batch // 2

    def batch_loss():  # half windows of the text, half the target's own continuations; the target's distribution
        starts = torch.randint(0, text.numel() - settings.seq_len, (half,), generator=gen).tolist()
        windows = torch.stack([text[s: s + settings.seq_len] for s in starts])
        rows = continued[torch.randint(0, continued.shape[0], (settings.batch - half,), generator=gen)]
        n = min(windows.shape[1], rows.shape[1])
        x = torch.cat([windows[:, :n], rows[:, :n]])
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=x).logits, -1)
        student = F.log_softmax(draft(input_ids=x).logits, -1)
        return F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")

    done, loss_value = run_steps(draft.parameters(), settings, reporter, batch_loss,
                                 describe=lambda kl: f"KL {kl:.3f}", log_every=20)
    draft.eval()
    with torch.no_grad():  # the demo ships fp16 weights (``demo_models.ship_fp16``): measure what ships
        for param in draft.parameters():
            param.copy_(param.half().float())
    alpha = measured_acceptance(target, draft, held)
    reporter.status(f"held-out acceptance {alpha:.3f} after {done} steps")
    draft.generation_config = copy.deepcopy(target.generation_config)
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=".draft-", dir=out.parent if out.parent.exists() else None))
    try:
        draft.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "training.json").write_text(json.dumps(
            {"text": "distilled from the target: its soft distribution over Debian fortunes' plain-prose quotations "
                     "and over its own greedy continuations of their openings", "target": Path(target_dir).name,
             "layers": layers, "steps": done, "kl": round(loss_value, 4),
             "seconds": round(time.perf_counter() - started, 1)}, indent=2))
        (tmp / SPECULATION_FILE).write_text(json.dumps(
            {"acceptance_rate": round(alpha, 4), "measured_on": "held-out lines (every 10th): the target's greedy "
             f"continuations of their first {OPENING_TOKENS} tokens, {continuation_tokens} tokens each, teacher-forced",
             "sequences": int(held.shape[0]), "target": Path(target_dir).name}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp), str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = ["SPECULATION_FILE", "distill_draft", "draft_of", "measured_acceptance", "stored_acceptance"]
