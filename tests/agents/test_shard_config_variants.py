"""Checkpoints with options our generator does not set still run exactly when split:
sliding-window attention (Mistral everywhere, Qwen2 on some layers only), GPT-2's
per-layer attention scaling, and a Llama with tied embeddings."""

from __future__ import annotations

import pytest
import torch
import transformers

from agents.local_pipeline import generate_partitioned
from agents.sampling import SamplingParams
from agents.shard import StageExecutor

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    # a 5-token window is shorter than the prompts, so the sliding masks really cut
    "mistral-sliding-5": lambda: transformers.MistralConfig(sliding_window=5, **SMALL),
    "qwen2-sliding-upper-layers": lambda: transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=4, max_window_layers=2, **SMALL),
    "gpt2-inverse-layer-scaling": lambda: transformers.GPT2Config(
        vocab_size=300, n_embd=64, n_layer=4, n_head=4, n_positions=128, scale_attn_by_inverse_layer_idx=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "llama-tied": lambda: transformers.LlamaConfig(tie_word_embeddings=True, **SMALL),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_split_run_of_config_variant_equals_generate(tmp_path, variant):
    config = VARIANTS[variant]()
    if variant.startswith("qwen2"):
        assert config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    with torch.random.fork_rng():
        torch.manual_seed(11)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]

    for split in ([(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 5), (5, 6)]):
        stages = [StageExecutor(str(tmp_path), a, b) for a, b in split]
        got = generate_partitioned(stages, ids, mask, SamplingParams(max_new_tokens=8))
        assert torch.equal(got.tokens, expected), split
