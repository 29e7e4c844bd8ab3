"""Screenshots saved small: PNGs of at most 256 colours.

A studio screenshot holds ~1,500 colours, nearly all of them anti-aliasing ramps of text and
box edges; Pillow's fast-octree palette of 256 (no dithering) keeps the text and the boxes as
they were (compared side by side) at about a third of the bytes (run-1600x1000: 149 KB as
Qt wrote it, 44 KB here), so re-taken screenshots do not bloat the repository.

    python scripts/small_png.py FILE.png ...     # rewrite PNGs in place
"""

from __future__ import annotations

import io
import sys
from pathlib import Path


def small_png_bytes(png: bytes) -> bytes:
    """``png`` re-encoded with a palette of at most 256 colours."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    image.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(out, "PNG", optimize=True)
    return out.getvalue()


def save_png(image, path: str | Path) -> Path:
    """Save a ``QPixmap`` or ``QImage`` to ``path`` as a small PNG."""
    from PySide6.QtCore import QBuffer, QIODevice

    buffer = QBuffer()
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise OSError(f"{path}: Qt could not encode the image as PNG")
    path = Path(path)
    path.write_bytes(small_png_bytes(bytes(buffer.data())))
    return path


def main(argv: list[str]) -> int:
    for name in argv:
        path = Path(name)
        before = path.stat().st_size
        path.write_bytes(small_png_bytes(path.read_bytes()))
        print(f"{path}: {before // 1024} KiB -> {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
