"""The unpartitioned model's greedy `generate()`: the reference split runs must equal."""

from __future__ import annotations


def hf_greedy_new_tokens(model_dir, enc, max_new_tokens: int, eos_token_id: int = 2, pad_token_id: int = 0,
                         **generate_options):
    """New tokens per sequence, each cut after its first EOS (as a run reports them);
    ``generate_options`` e.g. ``repetition_penalty=1.3``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, **generate_options)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        seq = []
        for t in row:
            seq.append(t)
            if t == eos_token_id:
                break
        rows.append(tuple(seq))
    return rows
