"""Generated checkpoints are real HF checkpoints, deterministic for a seed, with a working tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import transformers

from core.models.checkpoints import BENCHMARK_RECIPE, FAMILIES, ModelRecipe, build_config, make_model
from core.cli import main
from core.errors import FormatError, UnsupportedModelError


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def small(family: str = "llama", **kw) -> ModelRecipe:
    return ModelRecipe(**{"family": family, "layers": 2, "hidden": 64, "heads": 4, "vocab": 400, **kw})


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path):
    a = make_model(small(seed=1), tmp_path / "a")
    b = make_model(small(seed=1), tmp_path / "b")
    c = make_model(small(seed=2), tmp_path / "c")
    assert digest(a) == digest(b)
    assert set(digest(a)) >= {"config.json", "generation_config.json", "model.safetensors",
                              "tokenizer.json", "tokenizer_config.json"}
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert digest(a)["tokenizer.json"] == digest(c)["tokenizer.json"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_with_auto_classes(tmp_path, family):
    recipe = small(family, kv_heads=None if family == "gpt2" else 2)
    out = make_model(recipe, tmp_path / family)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["a lighthouse", "hi"], padding=True, return_tensors="pt")
    assert model(**batch).logits.shape[:2] == batch["input_ids"].shape


def test_tokenizer_round_trips_text_with_special_tokens_and_left_padding(tmp_path):
    out = make_model(small(), tmp_path / "m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left" and len(tokenizer) <= 400
    text = "The keeper's radio: 3 hops, 12 ms — and ünïcode too!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer("the lighthouse keeper")["input_ids"]) < len("the lighthouse keeper")  # merges learned
    padded = tokenizer(["one two three four", "one"], padding=True)["attention_mask"]
    assert padded[1][0] == 0 and padded[1][-1] == 1
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (2, 0)


def test_mixtral_recipe_sets_experts_and_gpt2_ties_embeddings():
    mixtral = build_config(small("mixtral", experts=3))
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (3, 2)
    assert build_config(small("gpt2")).tie_word_embeddings is True
    assert build_config(small("llama")).tie_word_embeddings is False
    assert build_config(small("llama", tie_embeddings=True)).tie_word_embeddings is True


def test_benchmark_recipe_has_100_to_300_million_parameters():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(build_config(BENCHMARK_RECIPE))
    assert 100e6 <= sum(p.numel() for p in model.parameters()) <= 300e6


@pytest.mark.parametrize("recipe,error,text", [
    (small(family="bert"), UnsupportedModelError, "not supported"),
    (small(hidden=64, heads=5), FormatError, "heads"),
    (small(heads=4, kv_heads=3), FormatError, "kv_heads"),
    (small(vocab=100), FormatError, "vocab"),
    (small(layers=0), FormatError, "layers"),
    (small(dtype="int8"), FormatError, "dtype"),
    (small("gpt2", kv_heads=2), FormatError, "kv_heads"),
])
def test_invalid_recipes_name_the_problem(tmp_path, recipe, error, text):
    with pytest.raises(error, match=text):
        make_model(recipe, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_refuses_to_overwrite_a_model(tmp_path):
    out = make_model(small(), tmp_path / "m")
    before = digest(out)
    with pytest.raises(FormatError, match="already holds a model"):
        make_model(small(seed=9), out)
    assert digest(out) == before


def test_cli_make_model_writes_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["make-model", "--family", "qwen2", "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--vocab", "300", "--seed", "5", str(out)])
    assert code == 0
    assert '"family": "qwen2"' in capsys.readouterr().out
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_key_value_heads, config.vocab_size) == ("qwen2", 2, 300)


def test_cli_reports_missing_options_without_traceback(tmp_path, capsys):
    code = main(["make-model", "--family", "llama", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code != 0 and "--layers" in err and "Traceback" not in err
    code = main(["make-model", "--family", "llama", "--layers", "2", "--hidden", "60", "--heads", "7", str(tmp_path / "y")])
    assert code != 0 and "heads" in capsys.readouterr().err


def test_check_model_dir_describes_a_runnable_checkpoint_and_rejects_others(tmp_path):
    from core.models.checkpoints import check_model_dir

    out = make_model(small("mixtral", kv_heads=2), tmp_path / "m")
    info = check_model_dir(out)
    assert (info.family, info.layers, info.hidden, info.num_units, info.sharded, info.has_tokenizer) == (
        "mixtral", 2, 64, 4, False, True)
    with pytest.raises(UnsupportedModelError, match="config.json"):
        check_model_dir(tmp_path / "nothing-here")
    (tmp_path / "weights-missing").mkdir()
    (tmp_path / "weights-missing" / "config.json").write_text((out / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        check_model_dir(tmp_path / "weights-missing")
