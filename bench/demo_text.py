"""What the demo model writes: prints one JSON line of sample texts per sampling setting.

Reads a trained demo checkpoint (default: the one the studio cached in the user's data
folder, ``gui.demo_model.trained_model_dir()``; ``--model DIR`` for another) and generates from
prompts of the kind the demo runs, with the agents' own sampler (``agents.local_pipeline``,
the code a split run executes; a split run's tokens equal it), under each sampling setting
(``--settings name=penalty:ngram,...``; penalty 1 = off, ngram 0 = off). Also reports the
model's mean loss per token on a fixed sample of the training text (its fit; the demo
model is trained on all of it) and the steps recorded in its training.json.

Usage: python bench/demo_text.py [--model DIR] [--tokens 16] [--settings greedy=1:0,demo=1.3:0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ("The secret of life is", "A wise man once said", "Love is", "You will", "Never",
           "The best way to", "Life is", "A friend is")
"""The demo's two prompts (gui.demo.DEMO_PROMPTS), the screenshots' two more, and other openings."""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint folder (default: the studio's cached trained demo model)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--settings", default="greedy=1:0,demo=1.3:0,penalty1.2=1.2:0,ngram3=1:3,mixed=1.15:3")
    ap.add_argument("--loss-lines", type=int, default=400, help="training lines the loss is measured on")
    args = ap.parse_args()

    import torch

    from agents.local_pipeline import generate_partitioned
    from agents.sampling import SamplingParams
    from agents.shard import StageExecutor
    from core.models.training import fortune_lines, trained_steps
    from core.runs.generation import load_tokenizer, stop_token_ids

    if args.model:
        model_dir = Path(args.model)
    else:
        from gui.demo_model import trained_model_dir

        model_dir = trained_model_dir()
    torch.set_num_threads(1)
    tok = load_tokenizer(str(model_dir))
    stops = stop_token_ids(str(model_dir), tok)
    config = json.loads((model_dir / "config.json").read_text())
    executor = StageExecutor(str(model_dir), 0, int(config["num_hidden_layers"]) + 2)
    enc = tok(list(PROMPTS), return_tensors="pt", padding=True)
    samples = {}
    for item in args.settings.split(","):
        name, spec = item.split("=")
        penalty, ngram = spec.split(":")
        params = SamplingParams(max_new_tokens=args.tokens, eos_token_ids=stops, pad_token_id=tok.pad_token_id,
                                repetition_penalty=float(penalty), no_repeat_ngram_size=int(ngram))
        out = generate_partitioned([executor], enc["input_ids"], enc["attention_mask"], params)
        texts = []
        for prompt, row in zip(PROMPTS, out.tokens.tolist()):
            kept = []
            for t in row:
                if t in stops:
                    break
                kept.append(t)
            texts.append(prompt + tok.decode(kept))
        samples[name] = texts

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    lines = fortune_lines()[:: max(1, len(fortune_lines()) // args.loss_lines)][: args.loss_lines]
    total, count = 0.0, 0
    with torch.no_grad():
        for line in lines:
            ids = torch.tensor([[tok.eos_token_id] + tok(line, add_special_tokens=False)["input_ids"]])
            loss = model(input_ids=ids, labels=ids).loss
            total += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    print(json.dumps({"model": str(model_dir), "steps": trained_steps(model_dir),
                      "train_text_loss": round(total / count, 3), "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
