"""Make real HF checkpoints (random weights, real tokenizer) of the families we can run.

Weights cannot be downloaded on an edge testbed, and tests need small models of every
family, so ``make_model`` builds a transformers config from a ``ModelRecipe``, draws
random weights with a fixed seed, writes them with ``save_pretrained`` (config.json,
model.safetensors, generation_config.json), and trains a byte-level BPE tokenizer with
the ``tokenizers`` library on the English text shipped in ``resources/text``. The result
is an ordinary HF checkpoint directory: ``AutoModelForCausalLM`` and ``AutoTokenizer``
load it, and so does an agent's ``StageExecutor``. The same seed gives the same files.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from core.errors import FormatError, UnsupportedModelError
from core.reporting import NullReporter, Reporter

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "mixtral")

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""Trained first, so their ids are 0, 1, 2 in every generated tokenizer."""

MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
"""A byte-level BPE needs all 256 byte symbols plus the special tokens."""

DTYPES = ("float32", "float16", "bfloat16")

TEXT_DIR = Path(__file__).resolve().parents[2] / "resources" / "text"


@dataclass(frozen=True)
class ModelRecipe:
    """Everything that determines a generated checkpoint (same recipe → same files)."""

    family: str
    layers: int
    hidden: int
    heads: int | None = None
    """Attention heads; default hidden // 64 (at least 1)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); default = heads. Not used by gpt2."""
    intermediate: int | None = None
    """MLP width; default ≈ 8/3·hidden rounded up to 64 (gpt2: 4·hidden)."""
    vocab: int = 1024
    experts: int = 4
    """Mixtral only: experts per layer (2 of them are active per token)."""
    experts_per_token: int = 2
    seed: int = 0
    dtype: str = "float32"
    max_positions: int = 2048
    tie_embeddings: bool | None = None
    """Share the embedding with the LM head; None = the family's default (gpt2 ties)."""

    def resolved(self) -> ModelRecipe:
        """The recipe with defaults filled in, after checking every field (FormatError)."""
        def bad(field: str, problem: str) -> FormatError:
            return FormatError("make-model", problem, field=field)

        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"model family {self.family!r} is not supported; use one of {', '.join(FAMILIES)}"
            )
        for field in ("layers", "hidden", "vocab", "max_positions"):
            if getattr(self, field) < 1:
                raise bad(field, "must be a positive integer")
        if self.vocab < MIN_VOCAB:
            raise bad("vocab", f"must be at least {MIN_VOCAB} (256 byte symbols + {len(SPECIAL_TOKENS)} special tokens)")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}")
        heads = self.heads if self.heads is not None else max(1, self.hidden // 64)
        if heads < 1 or self.hidden % heads:
            raise bad("heads", f"{heads} heads do not divide hidden size {self.hidden}")
        kv_heads = self.kv_heads if self.kv_heads is not None else heads
        if kv_heads < 1 or heads % kv_heads:
            raise bad("kv_heads", f"{kv_heads} key/value heads do not divide {heads} attention heads")
        if self.family == "gpt2" and kv_heads != heads:
            raise bad("kv_heads", "gpt2 has no grouped-query attention (kv_heads must equal heads)")
        if self.family != "gpt2" and (self.hidden // heads) % 2:
            raise bad("heads", f"head size {self.hidden // heads} must be even for rotary embeddings")
        if self.intermediate is not None:
            intermediate = self.intermediate
        elif self.family == "gpt2":
            intermediate = 4 * self.hidden
        else:
            intermediate = int(math.ceil(self.hidden * 8 / 3 / 64) * 64)
        if intermediate < 1:
            raise bad("intermediate", "must be a positive integer")
        if self.family == "mixtral" and not (1 <= self.experts_per_token <= self.experts):
            raise bad("experts", f"need at least {self.experts_per_token} experts, got {self.experts}")
        tie = self.tie_embeddings if self.tie_embeddings is not None else self.family == "gpt2"
        return replace(self, heads=heads, kv_heads=kv_heads, intermediate=intermediate, tie_embeddings=tie)


def build_config(recipe: ModelRecipe):
    """The transformers config for a recipe, token ids of the generated tokenizer included."""
    import transformers

    r = recipe.resolved()
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    common = dict(vocab_size=r.vocab, tie_word_embeddings=r.tie_embeddings, **ids)
    if r.family == "gpt2":
        return transformers.GPT2Config(
            n_embd=r.hidden, n_layer=r.layers, n_head=r.heads, n_inner=r.intermediate,
            n_positions=r.max_positions, **common,
        )
    rotary = dict(
        hidden_size=r.hidden, num_hidden_layers=r.layers, num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads, intermediate_size=r.intermediate,
        max_position_embeddings=r.max_positions, **common,
    )
    if r.family == "llama":
        return transformers.LlamaConfig(**rotary)
    if r.family == "mistral":
        return transformers.MistralConfig(**rotary)
    if r.family == "qwen2":
        return transformers.Qwen2Config(**rotary)
    return transformers.MixtralConfig(
        num_local_experts=r.experts, num_experts_per_tok=r.experts_per_token, **rotary
    )


def corpus_lines(text_dir: Path = TEXT_DIR) -> list[str]:
    """The shipped training text, one non-empty line per item, files in name order."""
    files = sorted(text_dir.glob("*.txt"))
    if not files:
        raise FormatError(str(text_dir), "no .txt files to train the tokenizer on")
    lines: list[str] = []
    for file in files:
        lines.extend(line for line in file.read_text(encoding="utf-8").splitlines() if line.strip())
    return lines


def train_tokenizer(vocab_size: int, text_dir: Path = TEXT_DIR):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (pad/bos/eos = ids 0/1/2, left padding).

    Its vocabulary is at most ``vocab_size``: a small corpus may yield fewer merges, and
    the model's embedding simply has unused rows then.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(text_dir), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=2048,
    )


def train_wordpiece_tokenizer(vocab_size: int, text_dir: Path = TEXT_DIR):
    """A BERT-style WordPiece ``PreTrainedTokenizerFast`` whose ``decode`` cleans up tokenization spaces
    (``clean_up_tokenization_spaces=True``: " ' s" -> "'s" over the whole text, which a text streamed
    piece by piece must equal); pad/bos/eos = ids 0/1/2 as ``train_tokenizer``'s, so a generated
    checkpoint can carry it instead."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, "[UNK]"],
                                        show_progress=False)
    tokenizer.train_from_iterator(corpus_lines(text_dir), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, unk_token="[UNK]", padding_side="left",
                                   model_max_length=2048, clean_up_tokenization_spaces=True)


def new_model_dir(out_dir: str | Path) -> Path:
    """``out_dir`` created for a new checkpoint; ``FormatError`` if it is a file or holds a model."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FormatError(str(out), "exists and is not a directory")
    if out.is_dir() and any(out.glob("*.safetensors*")):
        raise FormatError(str(out), "already holds a model; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def make_model(recipe: ModelRecipe, out_dir: str | Path, reporter: Reporter | None = None) -> Path:
    """Write the checkpoint of ``recipe`` to ``out_dir`` (created; existing model files refused)."""
    import torch
    import transformers

    reporter = reporter or NullReporter()
    r = recipe.resolved()
    out = new_model_dir(out_dir)
    steps = 3
    reporter.status("training the tokenizer")
    reporter.progress(0, steps)
    tokenizer = train_tokenizer(r.vocab)
    reporter.status(f"drawing {r.family} weights (seed {r.seed})")
    reporter.progress(1, steps)
    config = build_config(r)
    dtype = getattr(torch, r.dtype)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(r.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(dtype).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False
    )
    if reporter.cancel_requested():
        from core.reporting import Cancelled

        raise Cancelled()
    reporter.status(f"writing {out} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    reporter.progress(2, steps)
    transformers.utils.logging.disable_progress_bar()  # our reporter shows progress
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    reporter.status(f"done in {time.perf_counter() - started:.1f} s")
    reporter.progress(steps, steps)
    return out


BENCHMARK_RECIPE = ModelRecipe(
    family="llama", layers=12, hidden=1024, heads=16, kv_heads=16, intermediate=2816, vocab=8192, seed=0
)
"""The runtime benchmark's model: a Llama of ≈ 170 M parameters (≈ 0.7 GB in fp32)."""

PRESETS: dict[str, ModelRecipe] = {
    "tiny-llama": ModelRecipe(family="llama", layers=4, hidden=128, heads=4, kv_heads=2, vocab=1024),
    "bench-llama-170m": BENCHMARK_RECIPE,
}


def make_benchmark_model(out_dir: str | Path, reporter: Reporter | None = None) -> Path:
    """The ≈ 170 M-parameter Llama used by ``bench/runtime.py`` (well under a minute here)."""
    return make_model(BENCHMARK_RECIPE, out_dir, reporter)


@dataclass(frozen=True)
class ModelDirInfo:
    """What the runtime needs to know about a checkpoint directory before planning a run."""

    path: str
    family: str
    layers: int
    hidden: int
    vocab: int
    num_units: int
    sharded: bool
    has_tokenizer: bool


def check_model_dir(model_dir: str | Path) -> ModelDirInfo:
    """Check that ``model_dir`` is a checkpoint agents can run; ``UnsupportedModelError`` if not.

    Reads config.json and the safetensors index or header only (no weights), through the
    same reader the agents use, so what passes here loads on a device.
    """
    from agents.checkpoint_reader import CheckpointError, CheckpointReader, load_config

    path = Path(model_dir)
    try:
        config = load_config(path)
        CheckpointReader(path)
    except CheckpointError as err:
        raise UnsupportedModelError(str(err)) from None
    return ModelDirInfo(
        path=str(path),
        family=config.model_type,
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        vocab=int(config.vocab_size),
        num_units=int(config.num_hidden_layers) + 2,
        sharded=(path / "model.safetensors.index.json").is_file(),
        has_tokenizer=(path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file(),
    )


def check_weight_headers(model_dir: str | Path) -> None:
    """``check_model_dir``'s check of the weight files (the index parses; the single file's header
    reads) without torch or transformers: the studio's run path, whose config.json is checked on
    its own (``core.runs.generation.check_run``), imports neither (3.2 s of CPU here, taken from
    agents being profiled). The agents' reader finds its files the same way (``tensor_files``).
    ``UnsupportedModelError`` if not."""
    from agents.checkpoint_files import CheckpointError, tensor_files

    try:
        tensor_files(model_dir)
    except CheckpointError as err:
        raise UnsupportedModelError(str(err)) from None
