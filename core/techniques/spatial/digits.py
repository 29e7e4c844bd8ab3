"""The demo's CNN: a small ResNet-style net trained briefly on scikit-learn's handwritten digits.

A CNN with generated weights gives classes that mean nothing; the demo's spatial partitioning
shows a label a presenter can check. scikit-learn ships the UCI digits (1,797 8×8 grey images,
BSD) inside its package, so no download is needed. Each digit becomes an 8×8 RGB picture, read
through the same preprocessing as an image file (``images.image_tensor``: scaled to 32 pixels,
ImageNet-normalised), so the digit PNGs the demo ships (``write_digit_images``) are classified
exactly as in training. Every 5th digit is held out; ``train_digits_cnn`` reports its accuracy.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from core.reporting import Cancelled, NullReporter, Reporter
from core.techniques.spatial.problem import CnnRef

DIGITS_CNN = CnnRef(network="resnet-style", image=32, width_div=8, classes=10,
                    labels=tuple(str(d) for d in range(10)))
"""resnet-style at 32 pixels, channels 8–64: ~200 k parameters (400 KB in fp16), 16 spatial layers
that strips can split over three devices."""
WEIGHTS_FILE = "digits-cnn.safetensors"
CNN_FILE = "cnn.json"
"""The ``CnnRef`` (labels included; ``weights`` relative to the folder)."""


def digit_pictures():
    """(pictures as 8×8 RGB ``PIL.Image``s, labels) of scikit-learn's digits, in its order."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    grey = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return [Image.fromarray(g, mode="L").convert("RGB") for g in grey], [int(t) for t in d.target]


def held_out(i: int) -> bool:
    return i % 5 == 4


def train_digits_cnn(out_dir: str | Path, reporter: Reporter | None = None, max_seconds: float = 60.0,
                     epochs: int = 30, seed: int = 0) -> Path:
    """Train ``DIGITS_CNN`` on the digits not held out and write its weights (fp16) and ``cnn.json``
    to ``out_dir``; ``training.json`` says the held-out accuracy."""
    import torch
    from safetensors.torch import save_file

    from agents.techniques.spatial.network import build_network, weight_names
    from core.techniques.spatial.images import image_tensor

    reporter = reporter or NullReporter()
    pictures, labels = digit_pictures()
    x = torch.stack([image_tensor(p, DIGITS_CNN.image) for p in pictures])
    y = torch.tensor(labels)
    train = torch.tensor([not held_out(i) for i in range(len(labels))])
    net = build_network(DIGITS_CNN.spec(), seed=seed)
    params = net.tensors()
    for t in params:
        t.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    xs, ys = x[train], y[train]
    started, steps = time.perf_counter(), 0
    for epoch in range(epochs):
        for group in opt.param_groups:  # a cosine decay over the epochs: the last ones settle
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        order = torch.randperm(len(ys), generator=gen)
        for k in range(0, len(ys), 64):
            if reporter.cancel_requested():
                raise Cancelled()
            idx = order[k:k + 64]
            loss = torch.nn.functional.cross_entropy(net.forward(xs[idx]), ys[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        reporter.progress(epoch + 1, epochs)
        reporter.status(f"epoch {epoch + 1}/{epochs}, loss {float(loss.detach()):.3f}")
        if time.perf_counter() - started > max_seconds:
            break
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        save_file({n: t.detach().half().contiguous() for n, t in zip(weight_names(net.spec), params)},
                  str(out / WEIGHTS_FILE))
    (out / CNN_FILE).write_text(json.dumps({"network": DIGITS_CNN.network, "image": DIGITS_CNN.image,
                                            "width_div": DIGITS_CNN.width_div, "classes": DIGITS_CNN.classes,
                                            "labels": list(DIGITS_CNN.labels), "weights": WEIGHTS_FILE}, indent=2))
    trained = digits_cnn(out)
    with torch.no_grad():
        accuracy = float((trained.build().forward(x[~train]).argmax(1) == y[~train]).float().mean())
    (out / "training.json").write_text(json.dumps(
        {"data": "scikit-learn digits, every 5th held out", "steps": steps, "epochs": epoch + 1,
         "seconds": round(time.perf_counter() - started, 1), "held_out_accuracy": round(accuracy, 4)}, indent=2))
    reporter.status(f"held-out accuracy {accuracy:.1%}")
    return out


def digits_cnn(folder: str | Path) -> CnnRef:
    """The ``CnnRef`` of a trained digit CNN folder, its weights file named by absolute path (the
    agents read it from the same disk: the demo's agents are local processes)."""
    import msgspec

    folder = Path(folder).resolve()
    fields = json.loads((folder / CNN_FILE).read_text())
    fields["weights"] = str(folder / fields.get("weights", WEIGHTS_FILE))
    fields["labels"] = tuple(fields.get("labels", ()))
    return msgspec.convert(fields, CnnRef)


def write_digit_images(out_dir: str | Path, model: CnnRef | None = None, per_class: int = 1) -> list[Path]:
    """PNGs of held-out digits (never trained on), ``per_class`` of each, named ``digit-<label>-<n>.png``;
    with ``model``, the first held-out ones of each class it labels right (a demo shows right labels;
    ``training.json`` says how many held-out digits it gets right in all)."""
    import torch

    from core.techniques.spatial.images import image_tensor

    pictures, labels = digit_pictures()
    net = model.build() if model is not None else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    count: dict[int, int] = {}
    written = []
    for i, (picture, label) in enumerate(zip(pictures, labels)):
        if not held_out(i) or count.get(label, 0) >= per_class:
            continue
        if net is not None:
            with torch.no_grad():
                if int(net.forward(image_tensor(picture, model.image)[None]).argmax()) != label:
                    continue
        count[label] = count.get(label, 0) + 1
        path = out / f"digit-{label}-{count[label]}.png"
        picture.save(path)
        written.append(path)
    return sorted(written)


def label_of_file(path: str | Path) -> int | None:
    """The true digit of a ``write_digit_images`` file (from its name), else None."""
    parts = Path(path).stem.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "digit" and parts[1].isdigit() else None


__all__ = ["CNN_FILE", "DIGITS_CNN", "WEIGHTS_FILE", "digits_cnn", "label_of_file", "train_digits_cnn",
           "write_digit_images"]
