"""`edgeshard` sub-commands for model checkpoints (registered through the edgeshard.commands entry point)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from core.arguments import SEED, int_in
from core.models.checkpoints import DTYPES, FAMILIES, PRESETS, ModelRecipe, make_model
from core.errors import FormatError
from core.reporting import TerminalReporter


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""
    p = sub.add_parser(
        "make-model",
        help="write a real HF checkpoint with random weights and a trained tokenizer",
        description=(
            "Write an HF checkpoint (config.json, model.safetensors, generation_config.json, "
            "tokenizer) with random weights drawn from --seed and a byte-level BPE tokenizer "
            "trained on the shipped text. The same arguments give the same files."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to create (must not hold a model)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named recipe (other options override it)")
    p.add_argument("--family", choices=FAMILIES)
    p.add_argument("--layers", type=int_in(1, 1024), help="decoder blocks")
    p.add_argument("--hidden", type=int_in(1, 1 << 16), help="hidden size")
    p.add_argument("--heads", type=int_in(1, 1024), help="attention heads (default hidden/64)")
    p.add_argument("--kv-heads", type=int_in(1, 1024), help="key/value heads for grouped-query attention (default = heads)")
    p.add_argument("--intermediate", type=int_in(1, 1 << 18), help="MLP width (default ≈ 8/3·hidden; gpt2 4·hidden)")
    p.add_argument("--vocab", type=int_in(1, 1 << 20), help="vocabulary size (default 1024)")
    p.add_argument("--experts", type=int_in(1, 1024), help="mixtral: experts per layer (default 4)")
    p.add_argument("--seed", type=SEED, help="random seed of the weights (default 0)")
    p.add_argument("--dtype", choices=DTYPES, help="stored weight dtype (default float32)")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share embedding and LM head (default: gpt2 yes, others no)")
    p.set_defaults(func=_make_model)


_RECIPE_FIELDS = {
    "family": "family", "layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads",
    "intermediate": "intermediate", "vocab": "vocab", "experts": "experts", "seed": "seed",
    "dtype": "dtype", "tie_embeddings": "tie_embeddings",
}


def recipe_from_args(args: argparse.Namespace) -> ModelRecipe:
    """The recipe named by --preset and/or the options; names the missing option otherwise."""
    values = asdict(PRESETS[args.preset]) if args.preset else {}
    for arg, field in _RECIPE_FIELDS.items():
        if getattr(args, arg, None) is not None:
            values[field] = getattr(args, arg)
    for needed in ("family", "layers", "hidden"):
        if needed not in values:
            raise FormatError("make-model", "required (or give --preset)", field=f"--{needed}")
    return ModelRecipe(**values).resolved()


def _make_model(args: argparse.Namespace) -> int:
    from core.formats import check_writable

    recipe = recipe_from_args(args)
    check_writable(args.out_dir, "OUT_DIR", folder=True)  # before torch and transformers are imported
    out = make_model(recipe, args.out_dir, TerminalReporter())
    print(json.dumps({"model_dir": str(out), **asdict(recipe)}))
    return 0
