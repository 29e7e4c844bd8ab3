"""The demo's language models, one per technique that places an LLM, trained on the same text.

The demo tours five techniques on the same three emulated devices, each with a model of its
kind: layer sharding and attention offloading the quotation Llama (``LLAMA``), expert offloading
a small Mixtral (``MOE``), EPD a small Llava (``LLAVA``); spatial partitioning a digit CNN
(``core.techniques.spatial.digits``). All are trained briefly on text or data that ships with
the system (Debian's ``fortunes``, scikit-learn's digits) and shipped in
``resources/demo_models`` as fp16 safetensors (``ship_fp16``: a few MB in all), so a first launch
shows readable text at once instead of training for minutes; ``scripts/train_demo_models.py``
remakes them.

The Llava is trained as a whole (vision tower, projector, text model): each training window
starts with one image's tokens (a tile of a shipped picture), so its text reads as phrases
after an image prompt, the prompt layout ``core.models.multimodal.prompt_ids`` makes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from core.models.checkpoints import ModelRecipe
from core.models.multimodal import MultimodalRecipe
from core.reporting import NullReporter, Reporter

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "resources" / "demo_models"
"""The trained demo models in the repository (``scripts/train_demo_models.py`` writes them)."""

LLAMA = ModelRecipe(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, vocab=4096, seed=7)
"""The quotation Llama: hidden 128 / vocab 4096 gets ~830 steps in 150 s on 2 cores, where hidden
192 gets ~490 and loops; 4096 tokens hold most words whole (core/models/training.py)."""
MOE = ModelRecipe(family="mixtral", layers=4, hidden=96, heads=4, kv_heads=2, intermediate=128, vocab=2048,
                  experts=4, experts_per_token=2, seed=11)
"""A small Mixtral: 4 blocks of 4 experts (2 per token), so expert offloading has experts to keep
on storage; its smaller vocabulary keeps the shipped file small."""
LLAVA = MultimodalRecipe(layers=4, hidden=96, heads=4, kv_heads=2, intermediate=192, vocab=2048,
                         vision_layers=2, vision_hidden=32, vision_heads=2, tile=32, patch=8, seed=13)
"""A small Llava: a 2-layer CLIP tower on 32-pixel tiles (16 tokens each) and a 4-block Llama."""

NAMES = {"llama": "demo-llama", "moe": "demo-moe", "llava": "demo-llava", "llama-draft": "demo-llama-draft"}
"""Folder names under ``SHIPPED_DIR``. ``llama-draft``: the quotation Llama's speculative-decoding draft,
distilled from it (``core.models.draft_distillation``)."""


def shipped(kind: str) -> Path:
    """Where the trained model of ``kind`` (a key of ``NAMES``, or ``cnn``) ships."""
    return SHIPPED_DIR / (NAMES.get(kind) or "demo-digits-cnn")


def train_moe(lines: list[str], out_dir: str | Path, reporter: Reporter | None = None, settings=None) -> Path:
    """The MoE recipe trained on ``lines`` like the quotation Llama (``train_model``: same text,
    tokenizer recipe, schedule and time budget)."""
    from core.models.training import TrainingSettings, train_model

    return train_model(MOE, lines, out_dir, reporter, settings or TrainingSettings())


def train_llava(lines: list[str], out_dir: str | Path, reporter: Reporter | None = None, settings=None,
                recipe: MultimodalRecipe = LLAVA) -> Path:
    """A Llava of ``recipe`` trained on ``lines``, each window after one image's tokens."""
    import torch
    import transformers

    from core.models.checkpoints import train_tokenizer
    from core.models.multimodal import IMAGE_TOKEN, build_multimodal_config, load_image, synthetic_images
    from core.models.training import TrainingSettings, run_steps, token_stream

    reporter = reporter or NullReporter()
    settings = settings or TrainingSettings()
    recipe.check()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
        tokenizer = train_tokenizer(recipe.vocab - 1, Path(tmp))  # the last id stays free for <image>
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config = build_multimodal_config(recipe, image_id)
    data = token_stream(tokenizer, lines)
    tiles = torch.cat([load_image(p, recipe.tile) for p in synthetic_images()])
    torch.set_num_threads(max(1, settings.threads))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = transformers.LlavaForConditionalGeneration(config)
    model.train()
    gen = torch.Generator().manual_seed(settings.seed)
    n_img = recipe.tokens_per_tile
    prefix = torch.tensor([tokenizer.bos_token_id] + [image_id] * n_img)
    started = time.perf_counter()

    def batch_loss():
        starts = torch.randint(0, data.numel() - settings.seq_len, (settings.batch,), generator=gen).tolist()
        text = torch.stack([data[s: s + settings.seq_len] for s in starts])
        x = torch.cat([prefix.expand(settings.batch, -1), text], dim=1)
        labels = x.clone()
        labels[:, : 1 + n_img] = -100  # the image's tokens are input, never a target
        pixels = tiles[torch.randint(0, tiles.shape[0], (settings.batch,), generator=gen)]
        return model(input_ids=x, pixel_values=pixels, labels=labels).loss

    done, loss_value = run_steps(model.parameters(), settings, reporter, batch_loss)
    model.eval()
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                            do_sample=False)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "training.json").write_text(json.dumps(
        {"text": "Debian fortunes, plain-prose quotations, each window after one image's tokens",
         "steps": done, "loss": round(loss_value, 3), "seconds": round(time.perf_counter() - started, 1)},
        indent=2))
    return out


def ship_fp16(model_dir: str | Path, out_dir: str | Path) -> Path:
    """``model_dir``'s checkpoint rewritten with fp16 weights into ``out_dir`` (half the bytes), its
    config still saying float32: every loader (the agents' stages, ``from_pretrained``) computes in
    float32 from the fp16-rounded weights, so units, budgets and the references stay those of a
    float32 model and the shipped files are the model."""
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for path in src.glob("*.safetensors"):
        tensors = {k: (v.half() if v.is_floating_point() else v) for k, v in load_file(str(path)).items()}
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    for sub in ("text_config", "vision_config"):
        if isinstance(config.get(sub), dict):
            for key in ("dtype", "torch_dtype"):
                if key in config[sub]:
                    config[sub][key] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def folder_bytes(path: str | Path) -> int:
    """Bytes of every file under ``path`` (what a shipped model costs the repository)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


__all__ = ["LLAMA", "LLAVA", "MOE", "NAMES", "SHIPPED_DIR", "folder_bytes", "ship_fp16", "shipped", "train_llava",
           "train_moe"]
