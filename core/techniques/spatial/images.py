"""Image files as a CNN's input: what ``edgeshard run`` / ``edgeshard spatial run --image`` and the
studio's *Image files…* classify instead of seeded random images.

Each file (PNG, JPEG, anything Pillow reads; ``core.models.multimodal.read_rgb``) is scaled so its
shorter side is the network's input size, centre-cropped to a square (the usual ImageNet
preprocessing) and normalised with the ImageNet mean and deviation. A network with generated
weights gives classes that mean nothing (any picture still runs through the partitioned network
exactly like through one device); the demo's digit CNN (``core.techniques.spatial.digits``) was
trained on images made by this same ``image_tensor``, so its labels are right.
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
    import torch

    if not paths:
        raise SpatialInputError("no image files given")
    if len(paths) > MAX_FILES:
        raise SpatialInputError(f"{len(paths)} image files: at most {MAX_FILES} per run")
    return torch.stack([image_tensor(read_rgb(path), size) for path in paths]).contiguous()


def image_tensor(rgb, size: int):
    """One RGB ``PIL.Image`` as the network's 3×``size``×``size`` input (scaled, centre-cropped,
    normalised): the one preprocessing, so a CNN trained on images made this way (the demo's digits)
    sees its files exactly as in training."""
    import numpy as np
    import torch
    from PIL import Image

    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    scale = size / min(rgb.size)
    w, h = max(size, round(rgb.width * scale)), max(size, round(rgb.height * scale))
    rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    rgb = rgb.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - mean) / std


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "image_tensor", "load_images"]
