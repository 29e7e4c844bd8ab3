"""Train the demo's models and write them to resources/demo_models (fp16 safetensors), one JSON line each.

    python scripts/train_demo_models.py [--only llama,moe,llava,cnn,llama-draft] [--seconds 400]

The studio's demo ships these (core/models/demo_models.py says why), so a first launch needs no
training. Needs Debian's ``fortunes`` (the text) and scikit-learn (the digits). Each model trains
under its own time budget, like the demo's first-launch training; ``training.json`` beside each
says the steps, loss (or accuracy) and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.models import demo_models  # noqa: E402
from core.models.training import TrainingSettings, fortune_lines, train_model  # noqa: E402
from core.reporting import NullReporter  # noqa: E402


class _Printed(NullReporter):
    def status(self, text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="cnn,llama,moe,llava")
    p.add_argument("--seconds", type=float, default=400.0, help="each language model's training budget")
    p.add_argument("--draft-layers", type=int, default=2, help="llama-draft's decoder blocks")
    a = p.parse_args(argv)
    os.nice(5)
    lines = fortune_lines()
    settings = TrainingSettings(steps=1500, max_seconds=a.seconds, niceness=0, threads=1)
    for kind in a.only.split(","):
        started = time.perf_counter()
        out = demo_models.shipped(kind)
        with tempfile.TemporaryDirectory() as tmp:
            if kind == "cnn":
                from core.techniques.spatial.digits import train_digits_cnn, write_digit_images

                train_digits_cnn(out, _Printed(), max_seconds=a.seconds, epochs=24)
                from core.techniques.spatial.digits import digits_cnn

                write_digit_images(out / "images", digits_cnn(out))
            elif kind == "llama":
                demo_models.ship_fp16(train_model(demo_models.LLAMA, lines, Path(tmp) / "m", _Printed(), settings), out)
            elif kind == "moe":
                demo_models.ship_fp16(demo_models.train_moe(lines, Path(tmp) / "m", _Printed(), settings), out)
            elif kind == "llama-draft":  # distilled from the shipped demo-llama: train llama first
                from core.models.draft_distillation import distill_draft

                demo_models.ship_fp16(distill_draft(demo_models.shipped("llama"), lines, Path(tmp) / "m", a.draft_layers,
                                                    _Printed(), settings), out)
            elif kind == "llava":
                demo_models.ship_fp16(demo_models.train_llava(lines, Path(tmp) / "m", _Printed(), settings), out)
            else:
                p.error(f"unknown model {kind!r}")
        print(json.dumps({"model": kind, "path": str(out), "bytes": demo_models.folder_bytes(out),
                          "seconds": round(time.perf_counter() - started, 1), "load_1min": os.getloadavg()[0],
                          "training": json.loads((out / "training.json").read_text())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
