"""Generated Llava checkpoints load in transformers, images become validated tiles, prompts hold
one <image> per multimodal token."""

from __future__ import annotations

import hashlib

import pytest
import torch
import transformers

from core.errors import FormatError, UnsupportedModelError
from core.models.multimodal import (
    TINY_LLAVA,
    MultimodalRecipe,
    check_multimodal_dir,
    load_image,
    make_multimodal_model,
    prompt_ids,
    synthetic_images,
    tile_image,
)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_multimodal_model(TINY_LLAVA, tmp_path_factory.mktemp("llava") / "m")


def test_a_generated_llava_loads_in_transformers_and_generates_from_image_tiles(llava):
    info = check_multimodal_dir(llava)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(llava)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(llava))
    tiles = load_image(synthetic_images()[0], info.tile)
    ids = torch.tensor([prompt_ids(tok, "what is this", tiles.shape[0], info)])
    out = model.generate(input_ids=ids, pixel_values=tiles, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    assert info.tokens_per_tile == 16 and tok.convert_tokens_to_ids("<image>") == info.image_token_id


def test_the_same_recipe_gives_the_same_weights(tmp_path):
    a = make_multimodal_model(TINY_LLAVA, tmp_path / "a")
    b = make_multimodal_model(TINY_LLAVA, tmp_path / "b")
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b)


def test_a_recipe_whose_patch_does_not_divide_the_tile_is_refused_by_field():
    with pytest.raises(FormatError, match="patch"):
        MultimodalRecipe(tile=30, patch=8).check()


def test_a_directory_holding_a_text_model_is_not_taken_for_a_llava(tmp_path):
    from core.models.checkpoints import ModelRecipe, make_model

    path = make_model(ModelRecipe(family="llama", layers=1, hidden=64, heads=2, vocab=300), tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match="is not 'llava'"):
        check_multimodal_dir(path)


@pytest.mark.parametrize("tiles, grid", [(1, (1, 1)), (4, (2, 2)), (6, (2, 3))])
def test_an_image_becomes_the_tiles_asked_for_in_the_squarest_grid(tiles, grid):
    x = load_image(synthetic_images()[0], 32, tiles)
    assert tuple(x.shape) == (tiles, 3, 32, 32)


def test_tiles_are_read_row_by_row():
    image = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    tiles = tile_image(image, 2)
    assert tiles.shape == (6, 3, 2, 2)
    assert torch.equal(tiles[1], image[:, 0:2, 2:4]) and torch.equal(tiles[3], image[:, 2:4, 0:2])


def test_the_shipped_images_are_tiled_by_their_size():
    sizes = {p.name: load_image(p, 32).shape[0] for p in synthetic_images()}
    assert sizes["circles-96x64.png"] == 6 and sizes["noise-32.png"] == 1 and len(sizes) >= 4


def test_a_file_that_is_not_an_image_is_a_format_error_naming_it(tmp_path):
    bad = tmp_path / "photo.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(FormatError, match="photo.png.*not a readable image"):
        load_image(bad, 32)
    with pytest.raises(FormatError, match="no such image file"):
        load_image(tmp_path / "missing.png", 32)


def test_an_oversized_image_is_refused_before_it_is_decoded(tmp_path):
    from PIL import Image

    Image.new("L", (5000, 1)).save(tmp_path / "wide.png")
    with pytest.raises(FormatError, match="over 4096 pixels"):
        load_image(tmp_path / "wide.png", 32)
