import json

import pytest

from core.errors import FormatError, UnsupportedModelError
from core.models.units import (
    DTYPE_BYTES,
    load_model_spec,
    model_spec_from_config,
    shipped_model,
    shipped_model_names,
)


def _params(name: str) -> float:
    return shipped_model(name).num_parameters


def test_llama2_7b_table_sums_to_6_74b_parameters():
    assert _params("llama-2-7b") == pytest.approx(6.74e9, rel=0.005)


def test_llama2_70b_table_sums_to_69_0b_parameters():
    assert _params("llama-2-70b") == pytest.approx(69.0e9, rel=0.005)


def test_llama2_13b_table_sums_to_13_0b_parameters():
    assert _params("llama-2-13b") == pytest.approx(13.0e9, rel=0.005)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("gpt2", 124.4e6), ("mistral-7b", 7.24e9), ("qwen2-0.5b", 494e6), ("mixtral-8x7b", 46.7e9)],
)
def test_other_families_match_their_published_parameter_counts(name, expected):
    assert _params(name) == pytest.approx(expected, rel=0.005)


def test_units_are_embedding_blocks_then_head():
    spec = shipped_model("llama-2-7b")
    assert spec.num_units == 34
    assert [u.kind for u in spec.units] == ["embedding"] + ["decoder_block"] * 32 + ["head"]
    assert [u.index for u in spec.units] == list(range(34))


def test_block_sizes_follow_the_config_at_fp16():
    spec = shipped_model("llama-2-70b", "fp16")
    block = spec.units[1]
    assert block.activation_bytes_per_token == 8192 * 2
    # GQA: 8 KV heads of 128 dims, K and V, 2 bytes each
    assert block.kv_bytes_per_token == 2 * 8 * 128 * 2
    assert block.workspace_bytes_per_token == 2 * 28672 * 2
    assert block.param_bytes == block.params * 2
    head = spec.units[-1]
    assert head.activation_bytes_per_token == 8  # the sampled token id, int64 as the agents send it
    assert head.workspace_bytes_per_token == 32000 * 4  # fp32 logits
    assert spec.units[0].kv_bytes_per_token == 0


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_weight_bytes_scale_with_dtype(dtype):
    fp32 = shipped_model("llama-2-7b", "fp32")
    spec = shipped_model("llama-2-7b", dtype)
    assert spec.param_bytes == pytest.approx(fp32.param_bytes * DTYPE_BYTES[dtype] / 4, rel=1e-6)
    assert spec.num_parameters == fp32.num_parameters


def test_weight_only_quantization_keeps_16_bit_activations_and_kv():
    int4 = shipped_model("llama-2-7b", "int4")
    assert int4.units[1].activation_bytes_per_token == 4096 * 2
    assert int4.units[1].kv_bytes_per_token == 2 * 4096 * 2


def test_mixtral_counts_every_expert_for_memory_but_top_k_for_flops():
    spec = shipped_model("mixtral-8x7b")
    block = spec.units[1]
    one_expert = 3 * 4096 * 14336
    assert block.params > 8 * one_expert
    assert block.flops_per_token < 2 * (3 * one_expert)


def test_tied_head_is_counted_once_but_stored_on_its_stage():
    spec = shipped_model("qwen2-0.5b", "bf16")
    head = spec.units[-1]
    assert head.params == 896  # the final norm only; the weights are the embedding's
    assert head.param_bytes >= 151936 * 896 * 2


def test_unknown_family_names_what_is_missing():
    with pytest.raises(UnsupportedModelError, match="model_type 'bert'"):
        model_spec_from_config({"model_type": "bert", "hidden_size": 8})
    with pytest.raises(UnsupportedModelError, match="no 'model_type'"):
        model_spec_from_config({"hidden_size": 8})


def test_missing_key_is_named():
    cfg = json.loads((shipped_model.__globals__["SHIPPED_MODELS_DIR"] / "llama-2-7b" / "config.json").read_text())
    del cfg["intermediate_size"]
    with pytest.raises(UnsupportedModelError, match="intermediate_size"):
        model_spec_from_config(cfg)


def test_unknown_dtype_is_rejected():
    with pytest.raises(UnsupportedModelError, match="dtype"):
        shipped_model("gpt2", "fp8")


def test_load_from_a_directory_or_file(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100,
    }))
    spec = load_model_spec(tmp_path / "m")
    assert spec.num_units == 4 and spec.name == "m"
    assert load_model_spec(tmp_path / "m" / "config.json").units == spec.units


def test_malformed_config_file_is_a_format_error(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(FormatError, match="config.json"):
        load_model_spec(bad)


def test_shipped_models_include_the_paper_models():
    assert {"llama-2-7b", "llama-2-13b", "llama-2-70b"} <= set(shipped_model_names())
