"""Image files as a CNN's input: what ``edgeshard run`` / ``edgeshard spatial run --image`` and the
studio's *Image files…* classify instead of seeded random images.

Each file (PNG, JPEG, anything Pillow reads; ``core.models.multimodal.read_rgb``) is scaled so its
shorter side is the network's input size, centre-cropped to a square (the usual ImageNet
preprocessing) and normalised with the ImageNet mean and deviation. The networks' weights are
generated, not trained, so the classes mean nothing; what a real image shows is that any picture
runs through the partitioned network exactly like through one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from core.models.multimodal import read_rgb
from core.techniques.spatial.problem import SpatialInputError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MAX_FILES = 10_000


def load_images(paths: Sequence[str | Path], size: int):
    """The files as one N×3×``size``×``size`` float32 tensor, in the order given. A bad file is a
    ``FormatError`` naming it (nothing is run); no files is a ``SpatialInputError``."""
    import numpy as np
    import torch
    from PIL import Image

    if not paths:
        raise SpatialInputError("no image files given")
    if len(paths) > MAX_FILES:
        raise SpatialInputError(f"{len(paths)} image files: at most {MAX_FILES} per run")
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    out = []
    for path in paths:
        rgb = read_rgb(path)
        scale = size / min(rgb.size)
        w, h = max(size, round(rgb.width * scale)), max(size, round(rgb.height * scale))
        rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
        left, top = (w - size) // 2, (h - size) // 2
        rgb = rgb.crop((left, top, left + size, top + size))
        x = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
        out.append((x - mean) / std)
    return torch.stack(out).contiguous()


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "load_images"]
