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

    q = sub.add_parser(
        "measure-precision", help="perplexity and block times per weight precision, stored in the model's profile",
        description=("Measure once, with the whole model in this process at fp, int8 and int4 weights (the agents' "
                     "own stage code): held-out perplexity and the decoder blocks' decode/prefill time over fp. "
                     "Stored as the profile's weight_quality, they let `edgeshard plan --quality-bound` give "
                     "devices quantized weights."),
    )
    q.add_argument("model_dir", metavar="MODEL_DIR")
    q.add_argument("--profile", required=True, metavar="PROFILE.json", help="the model's profile (edgeshard.profile)")
    q.add_argument("--out", metavar="FILE", help="where to write the profile with them (default: --profile itself)")
    q.add_argument("--texts", metavar="FILE", help="held-out text, one per line (default: the quotations the demo "
                                                    "model never trains on)")
    q.add_argument("--lines", type=int_in(1, 100_000), default=100, help="texts used (default 100)")
    q.add_argument("--timing-steps", type=int_in(1, 10_000), default=16, help="decode steps timed per round (default 16)")
    q.add_argument("--rounds", type=int_in(1, 100), default=3, help="timing rounds, precisions interleaved; the best "
                                                                    "counts (default 3)")
    q.set_defaults(func=_measure_precision)


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


_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _measure_precision(args: argparse.Namespace) -> int:
    from pathlib import Path

    import msgspec

    from core.devices.profile import Profile, profile_errors
    from core.formats import check_writable, load, save
    from core.models.units import load_model_spec
    from core.models.weight_quality import measure_weight_quality
    from core.planning.precision import quantizable

    profile = load(args.profile, Profile)
    errors = profile_errors(profile)
    if errors:
        field, _, msg = errors[0].partition(": ")
        raise FormatError(args.profile, msg, field)
    spec = load_model_spec(args.model_dir, profile.model.dtype)
    if spec.num_units != profile.model.num_units or spec.family != profile.model.family:
        raise FormatError(args.profile, f"this profile is of a {profile.model.family} model of {profile.model.num_units} "
                          f"units, {args.model_dir} holds a {spec.family} model of {spec.num_units}: profile this model")
    if profile.model.dtype not in _TORCH_DTYPES:
        raise FormatError(args.profile, f"weights at {profile.model.dtype} are quantized already: measure an fp profile",
                          "$.model.dtype")
    precisions = tuple(w for w in ("fp", "int8", "int4") if quantizable(spec, w))
    if precisions == ("fp",):
        raise FormatError(args.model_dir, f"{spec.family} models load at fp weights only: nothing to measure")
    out = args.out or args.profile
    check_writable(out, "--out")
    if args.texts:
        try:
            lines = [t for t in Path(args.texts).read_text().splitlines() if t.strip()]
        except OSError as err:
            raise FormatError(args.texts, f"cannot read it ({err.strerror})") from None
        note = f"{args.texts}"
    else:
        from core.models.training import fortune_lines, held_out_split

        lines = held_out_split(fortune_lines())[1]
        note = "held-out quotations (every 10th fortune, never trained on)"
    from core.runs.generation import load_tokenizer

    tok = load_tokenizer(args.model_dir)
    texts = [ids for ids in (tok(t)["input_ids"] for t in lines[:args.lines]) if len(ids) >= 2]
    if not texts:
        raise FormatError(args.texts or "texts", "no text of two tokens or more to measure perplexity on")
    quality = measure_weight_quality(args.model_dir, texts, precisions, dtype=_TORCH_DTYPES[profile.model.dtype],
                                     timing_steps=args.timing_steps, rounds=args.rounds,
                                     text_note=f"{note}: {len(texts)} texts", reporter=TerminalReporter())
    save(out, msgspec.structs.replace(profile, weight_quality=quality))
    base = quality[0].perplexity
    for q in quality:
        print(f"{q.weights:>4}: perplexity {q.perplexity:.3f} ({(q.perplexity / base - 1) * 100:+.2f} %), "
              f"decode {q.decode_time_ratio:.2f}x, prefill {q.prefill_time_ratio:.2f}x of fp")
    print(f"profile written to {out}")
    return 0
