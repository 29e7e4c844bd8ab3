"""The demo's models: a small Llama recipe, its trained checkpoint shipped in the repository
(``resources/demo_models``, core/models/demo_models.py), its untrained checkpoint (cached, remade
in seconds) and its training on English quotations (Debian's ``fortunes``, core/models/training.py)
in a child process, cached in the user's data folder and continued while it has too few steps;
and the model of every other technique the demo tours (``demo_checkpoints``).

Tests and the demo reach these through the module (``demo_model.DEMO_TRAINING``), so a test
that sets one setting sets it for every user of it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from core.reporting import Reporter

DEMO_MODEL_NAME = "demo-llama"
DEMO_TRAINING = None
"""``core.models.training.TrainingSettings`` for the demo model (None: its defaults, ~2–3 min on 2 cores)."""


def demo_recipe():
    from core.models.demo_models import LLAMA

    return LLAMA


DEMO_TECHNIQUE_MODELS = {"layer-sharding": "llama", "attention-offload": "llama", "expert-offload": "moe",
                         "phase-disaggregation": "llava", "spatial": "cnn"}
"""Which demo model each technique tours with (``core.models.demo_models.shipped`` names the folders)."""


def demo_checkpoints(llama: str | Path | None = None) -> dict[str, str]:
    """Technique name -> the checkpoint the demo plans and runs it with: the quotation Llama
    (``llama``: the one in use, else the shipped one) for layer sharding and attention offloading,
    the shipped MoE (a Mixtral) for expert offloading, the shipped Llava for EPD, and the shipped
    digit CNN's folder (``core.techniques.spatial.digits.digits_cnn`` reads it; its ``images/``
    are held-out digits) for spatial partitioning. Only shipped models that are there are named."""
    from core.models.demo_models import shipped

    out = {}
    for technique, kind in DEMO_TECHNIQUE_MODELS.items():
        path = Path(llama) if kind == "llama" and llama else shipped(kind)
        if path.is_dir():
            out[technique] = str(path)
    return out


def shipped_model_dir() -> Path | None:
    """The trained quotation Llama in the repository, when it is there and of the current recipe."""
    from core.models.demo_models import shipped

    out = shipped("llama")
    return out if (out / "training.json").is_file() and any(out.glob("*.safetensors")) and holds_demo_recipe(out) \
        else None


def holds_demo_recipe(model_dir: Path) -> bool:
    """Whether ``model_dir``'s config.json is the current demo recipe's (a checkpoint cached
    by an older studio with another recipe is remade, not reused). Reads JSON only: this runs
    before the studio has imported torch."""
    import json

    r = demo_recipe().resolved()
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    wanted = {"model_type": r.family, "num_hidden_layers": r.layers, "hidden_size": r.hidden,
              "num_attention_heads": r.heads, "num_key_value_heads": r.kv_heads,
              "intermediate_size": r.intermediate, "vocab_size": r.vocab}
    return all(config.get(k) == v for k, v in wanted.items())

def cache_dir() -> Path:
    """Untrained checkpoints (remade in seconds when missing)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgeshard" / "demo"


def data_dir() -> Path:
    """The trained demo model: user data (minutes to remake), beside the workspace file."""
    from core.paths import workspace_file

    return workspace_file().parent / "demo"


def trained_model_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / f"{DEMO_MODEL_NAME}-trained"


def has_trained_model(root: Path | None = None) -> bool:
    """A trained demo model is there: cached under ``root``, or (the user's own data folder, ``root``
    None) the one shipped in the repository."""
    out = trained_model_dir(root)
    cached = (out / "training.json").is_file() and any(out.glob("*.safetensors")) and holds_demo_recipe(out)
    return cached or (root is None and shipped_model_dir() is not None)


def ensure_demo_model(reporter: Reporter, root: Path | None = None) -> Path:
    """The trained demo checkpoint if cached, else (for the user's own data folder) the one shipped
    in the repository, else the untrained one, made once and reused. A ``root`` of its own (tests)
    never takes the shipped one, so its training can be watched."""
    from core.models.checkpoints import make_model

    shipped = shipped_model_dir() if root is None else None
    if shipped is not None:
        reporter.status(f"using the trained demo model shipped in {shipped}")
        return shipped
    if has_trained_model(root):
        reporter.status(f"using the trained demo model in {trained_model_dir(root)}")
        return trained_model_dir(root)
    root = root or cache_dir()
    out = root / DEMO_MODEL_NAME
    if any(out.glob("*.safetensors")) and holds_demo_recipe(out):
        reporter.status(f"using the untrained demo model in {out}")
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=ensure_dir(root)))
    try:
        make_model(demo_recipe(), tmp / "m", reporter)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "m", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


DEMO_ENOUGH_STEPS = 500
"""Training steps after which the demo model is left as it is. A quiet 2-core machine does ~830
in the 150 s budget; a busy one can stop after a few dozen (a model that answers "." to
everything), so a launch that finds fewer continues the training from the cached checkpoint."""


def needs_more_training(root: Path | None = None) -> bool:
    """Whether the cached trained demo model stopped short of ``DEMO_ENOUGH_STEPS`` (none is used
    beside the shipped one)."""
    from core.models.training import trained_steps

    if root is None and shipped_model_dir() is not None:
        return False
    return has_trained_model(root) and trained_steps(trained_model_dir(root)) < DEMO_ENOUGH_STEPS


def train_demo_model(reporter: Reporter, root: Path | None = None, resume: bool = False) -> Path:
    """Worker job: train the demo recipe on the fortunes text in a child process (cancellable);
    ``resume`` continues the cached trained model's training."""
    from core.models.training import TrainingSettings, train_in_subprocess

    return train_in_subprocess(reporter, demo_recipe(), trained_model_dir(root), DEMO_TRAINING or TrainingSettings(),
                               resume=resume)

def ensure_dir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
