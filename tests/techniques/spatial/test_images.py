"""Image files as a CNN's input: PNG and JPEG are read, scaled and centre-cropped to the network's
input; a file that is not an image (or is missing) is refused naming it."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from core.errors import FormatError
from core.techniques.spatial.images import IMAGENET_MEAN, IMAGENET_STD, load_images
from core.techniques.spatial.problem import SpatialInputError


def _banded(path, fmt: str) -> str:
    """A 96×32 picture: red left and right thirds, blue centre third."""
    im = Image.new("RGB", (96, 32), (255, 0, 0))
    im.paste((0, 0, 255), (32, 0, 64, 32))
    im.save(path, format=fmt)
    return str(path)


@pytest.mark.parametrize("fmt,suffix", [("PNG", "png"), ("JPEG", "jpg")])
def test_a_wide_image_is_scaled_to_its_shorter_side_and_centre_cropped(tmp_path, fmt, suffix):
    x = load_images([_banded(tmp_path / f"band.{suffix}", fmt)], 16)
    assert x.shape == (1, 3, 16, 16) and x.dtype == torch.float32
    pixel = x[0, :, 8, 8] * torch.tensor(IMAGENET_STD) + torch.tensor(IMAGENET_MEAN)
    torch.testing.assert_close(pixel, torch.tensor([0.0, 0.0, 1.0]), atol=0.05, rtol=0)  # the blue centre only
    edge = x[0, :, :, 0] * torch.tensor(IMAGENET_STD).view(3, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1)
    assert float(edge[0].max()) < 0.3  # no red from the cropped thirds (red would be 1)


def test_files_are_stacked_in_the_order_given(tmp_path):
    Image.new("RGB", (8, 8), (0, 0, 0)).save(tmp_path / "black.png")
    Image.new("RGB", (8, 8), (255, 255, 255)).save(tmp_path / "white.png")
    x = load_images([tmp_path / "white.png", tmp_path / "black.png"], 8)
    assert float(x[0].mean()) > float(x[1].mean())


def test_a_file_that_is_not_an_image_is_refused_naming_it(tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("hello")
    with pytest.raises(FormatError, match=r"notes\.png.*not a readable image"):
        load_images([bad], 32)


def test_a_missing_file_and_no_files_are_refused(tmp_path):
    with pytest.raises(FormatError, match="no such image file"):
        load_images([tmp_path / "gone.jpg"], 32)
    with pytest.raises(SpatialInputError, match="no image files"):
        load_images([], 32)
