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


def hf_seeded_new_tokens(model_dir, enc, max_new_tokens: int, groups, *, temperature: float, top_p: float, seed: int,
                         eos_token_id: int = 2, pad_token_id: int = 0):
    """Seeded sampling's reference: transformers' own ``generate()`` computes every logit (the unsplit
    model, its cache, masks and positions), and a logits processor draws each step's token by the
    sampling rule runs use (``agents.sampling.sample`` with ``step_generator(seed, group, step)``, keyed by
    the micro-batch ``groups`` index of the row and the step), so only the draw rule is shared with a run."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from agents.sampling import SamplingParams, sample, step_generator

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens,
                            eos_token_ids=(eos_token_id,), pad_token_id=pad_token_id)
    rows: dict[int, tuple[int, ...]] = {}
    for key, members in enumerate(groups):
        ids, mask = enc["input_ids"][list(members)], enc["attention_mask"][list(members)]

        def draw(input_ids, scores, key=key, start=ids.shape[1]):
            step = input_ids.shape[1] - start
            picked = sample(scores.float(), params, step_generator(seed, key, step))
            forced = torch.full_like(scores, float("-inf"))
            forced[torch.arange(scores.shape[0]), picked] = 0.0
            return forced

        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([draw]), pad_token_id=pad_token_id,
                                 eos_token_id=eos_token_id)
        for member, row in zip(members, out[:, ids.shape[1]:].tolist()):
            seq = []
            for t in row:
                seq.append(t)
                if t == eos_token_id:
                    break
            rows[member] = tuple(seq)
    return [rows[i] for i in sorted(rows)]
