"""Image–text checkpoints (transformers' Llava family) and the images and prompts they read.

Phase disaggregation (EPD) needs a model with a vision tower: ``make_multimodal_model``
writes a tiny ``LlavaForConditionalGeneration`` (a CLIP vision tower, the two-layer
projector and a Llama text model) with random weights from a fixed seed, and the project's
byte-level BPE tokenizer plus an ``<image>`` token, like ``core.models.checkpoints`` does
for the text families. Any local Llava checkpoint with a CLIP vision tower and a Llama text
model loads the same way (``check_multimodal_dir``).

An image is cut into square **tiles** of the vision tower's input size (the anyres idea:
more pixels, more tiles, more multimodal tokens); each tile is one Llava image of
``image_seq_length`` tokens, so one request's tiles can be encoded on several devices (IRP)
and the single-process ``generate(input_ids, pixel_values=tiles)`` is the reference.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from core.errors import FormatError, UnsupportedModelError
from core.reporting import NullReporter, Reporter

IMAGE_TOKEN = "<image>"
IMAGES_DIR = Path(__file__).resolve().parents[2] / "resources" / "images"
MAX_IMAGE_SIDE = 4096
"""Larger files are refused before decoding (a decompression bomb is not an image to tile)."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class MultimodalRecipe:
    """Everything that determines a generated Llava checkpoint (same recipe → same files)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 1024
    vision_layers: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    tile: int = 32
    """Side of one tile in pixels (the vision tower's image size)."""
    patch: int = 8
    seed: int = 0

    def check(self) -> None:
        def bad(field: str, problem: str) -> FormatError:
            return FormatError("make-multimodal-model", problem, field=field)

        for field in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vision_layers", "vision_hidden",
                      "vision_heads", "tile", "patch"):
            if getattr(self, field) < 1:
                raise bad(field, "must be a positive integer")
        if self.vocab < 260:
            raise bad("vocab", "must be at least 260 (256 byte symbols, 3 special tokens and <image>)")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise bad("heads", f"{self.heads} heads / {self.kv_heads} kv heads do not fit hidden {self.hidden} "
                               "(even head size, kv heads dividing heads)")
        if self.vision_hidden % self.vision_heads:
            raise bad("vision_heads", f"{self.vision_heads} heads do not divide {self.vision_hidden}")
        if self.tile % self.patch:
            raise bad("patch", f"patch {self.patch} does not divide the tile side {self.tile}")

    @property
    def tokens_per_tile(self) -> int:
        return (self.tile // self.patch) ** 2


TINY_LLAVA = MultimodalRecipe()


def build_multimodal_config(recipe: MultimodalRecipe, image_token_id: int):
    import transformers

    recipe.check()
    text = transformers.LlamaConfig(
        vocab_size=recipe.vocab, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    vision = transformers.CLIPVisionConfig(
        image_size=recipe.tile, patch_size=recipe.patch, hidden_size=recipe.vision_hidden,
        intermediate_size=2 * recipe.vision_hidden, num_hidden_layers=recipe.vision_layers,
        num_attention_heads=recipe.vision_heads,
    )
    return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                                    image_seq_length=recipe.tokens_per_tile, tie_word_embeddings=False)


def make_multimodal_model(recipe: MultimodalRecipe, out_dir: str | Path, reporter: Reporter | None = None) -> Path:
    """Write the Llava checkpoint of ``recipe`` to ``out_dir`` (created; existing model files refused)."""
    import torch
    import transformers

    from core.models.checkpoints import new_model_dir, train_tokenizer

    reporter = reporter or NullReporter()
    recipe.check()
    out = new_model_dir(out_dir)
    reporter.status("training the tokenizer")
    tokenizer = train_tokenizer(recipe.vocab - 1)  # the last id stays free for <image>
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if not 0 <= image_id < recipe.vocab:
        raise FormatError("make-multimodal-model", f"<image> got id {image_id}, outside the vocabulary", field="vocab")
    config = build_multimodal_config(recipe, image_id)
    reporter.status(f"drawing Llava weights (seed {recipe.seed})")
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = transformers.LlavaForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                            do_sample=False)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    reporter.status(f"done in {time.perf_counter() - started:.1f} s")
    return out


@dataclass(frozen=True)
class MultimodalInfo:
    """What a run needs to know of a Llava checkpoint before loading it anywhere."""

    path: str
    image_token_id: int
    tokens_per_tile: int
    tile: int
    vocab: int
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int


def check_multimodal_dir(model_dir: str | Path) -> MultimodalInfo:
    """Check that ``model_dir`` is a Llava checkpoint this project runs (CLIP vision tower, Llama
    text model, one feature layer); ``UnsupportedModelError`` says what is not."""
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UnsupportedModelError(f"{path}: no config.json; pass a Llava checkpoint directory")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UnsupportedModelError(f"{cfg_file}: not readable JSON ({err})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "llava":
        raise UnsupportedModelError(f"{path}: model_type {cfg.get('model_type') if isinstance(cfg, dict) else None!r}"
                                    " is not 'llava'; phase disaggregation runs Llava checkpoints")
    vision, text = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    if vision.get("model_type") != "clip_vision_model" or text.get("model_type") != "llama":
        raise UnsupportedModelError(f"{path}: needs a CLIP vision tower and a Llama text model, got "
                                    f"{vision.get('model_type')!r} and {text.get('model_type')!r}")
    if not isinstance(cfg.get("vision_feature_layer", -2), int):
        raise UnsupportedModelError(f"{path}: several vision feature layers are not supported")
    if not any(path.glob("*.safetensors")):
        raise UnsupportedModelError(f"{path}: no .safetensors weights")
    tile, patch = int(vision["image_size"]), int(vision["patch_size"])
    strategy = cfg.get("vision_feature_select_strategy", "default")
    per_tile = (tile // patch) ** 2 + (0 if strategy == "default" else 1)
    heads = int(text["num_attention_heads"])
    return MultimodalInfo(
        path=str(path), image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", -1))),
        tokens_per_tile=per_tile, tile=tile, vocab=int(text["vocab_size"]), layers=int(text["num_hidden_layers"]),
        kv_heads=int(text.get("num_key_value_heads", heads)), head_dim=int(text["hidden_size"]) // heads,
        hidden=int(text["hidden_size"]),
    )


# --------------------------------------------------------------------------- images

def load_image(path: str | Path, tile: int, tiles: int | None = None):
    """The image at ``path`` as normalised tiles (N×3×tile×tile float32, row-major), via Pillow.

    The image is resized to a whole grid of tiles (``tiles``: that many, in the squarest grid
    rows × columns, e.g. 6 → 2 × 3; else the grid nearest its size). A missing, unreadable or oversized file is a ``FormatError``
    naming the file, never a traceback."""
    import numpy as np
    import torch
    from PIL import Image

    p = Path(path)
    rgb = read_rgb(p)
    if tiles is not None:
        if not 1 <= tiles <= 1024:
            raise FormatError(str(p), f"tiles must be in [1, 1024], got {tiles}")
        rows = max(r for r in range(1, int(tiles ** 0.5) + 1) if tiles % r == 0)
        cols = tiles // rows
    else:
        cols, rows = max(1, round(rgb.width / tile)), max(1, round(rgb.height / tile))
    rgb = rgb.resize((cols * tile, rows * tile), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean, std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)
    return tile_image((x - mean) / std, tile)


def read_rgb(path: str | Path):
    """The image file at ``path`` (PNG, JPEG, anything Pillow reads) as an RGB ``PIL.Image``. A missing,
    unreadable or oversized file, or no Pillow, is a ``FormatError`` naming the file, never a traceback."""
    p = Path(path)
    if not p.is_file():
        raise FormatError(str(p), "no such image file")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise FormatError(str(p), "reading image files needs Pillow (pip install pillow)") from None
    try:
        with Image.open(p) as im:
            if max(im.size) > MAX_IMAGE_SIDE:
                raise FormatError(str(p), f"image is {im.size[0]}×{im.size[1]}, over {MAX_IMAGE_SIDE} pixels a side")
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise FormatError(str(p), f"not a readable image ({type(err).__name__}: {err})") from None


def tile_image(image, tile: int):
    """A 3×H×W image (H, W multiples of ``tile``) as its tiles, row by row: N×3×tile×tile."""
    c, h, w = image.shape
    if c != 3 or h % tile or w % tile:
        raise FormatError("image", f"needs 3×H×W with H and W multiples of {tile}, got {list(image.shape)}")
    return (image.reshape(3, h // tile, tile, w // tile, tile).permute(1, 3, 0, 2, 4)
            .reshape(-1, 3, tile, tile).contiguous())


def synthetic_images() -> list[Path]:
    """The shipped image set (resources/images/*.png), in name order."""
    return sorted(IMAGES_DIR.glob("*.png"))


def prompt_ids(tokenizer, text: str, tiles: int, info: MultimodalInfo) -> list[int]:
    """``<bos>``, one ``<image>`` per multimodal token of ``tiles`` tiles, then the text's tokens:
    the order Llava's processor gives an image-then-question prompt."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [1] + [info.image_token_id] * (tiles * info.tokens_per_tile) + list(ids)


__all__ = [
    "IMAGE_TOKEN", "MultimodalInfo", "MultimodalRecipe", "TINY_LLAVA", "build_multimodal_config",
    "check_multimodal_dir", "load_image", "make_multimodal_model", "prompt_ids", "read_rgb", "synthetic_images",
    "tile_image",
]
