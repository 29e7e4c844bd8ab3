"""A model split into stages produces exactly what the whole HF model produces.

For every supported family, a chain of ``StageExecutor``s (1 to 4 stages, uneven splits)
is run in-process on a left-padded batch of prompts of different lengths and compared
with ``AutoModelForCausalLM.generate()`` on the unsplit checkpoint.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from agents.local_pipeline import generate_partitioned
from agents.sampling import SamplingParams
from agents.shard import DecodeMasks, StageExecutor
from core.models.checkpoints import FAMILIES

PROMPTS = [
    "The lighthouse keeper climbed the steps",
    "Hello",
    "A chain is only as strong as its weakest link, and a pipeline",
]

# 4 blocks → units 0 (embedding), 1..4 (blocks), 5 (norm + head).
PARTITIONS = {
    "1-stage": [(0, 6)],
    "embedding-alone": [(0, 1), (1, 6)],
    "2-uneven": [(0, 4), (4, 6)],
    "3-uneven": [(0, 2), (2, 3), (3, 6)],
    "4-head-alone": [(0, 1), (1, 2), (2, 5), (5, 6)],
}
MAX_NEW = 10


def encode(model_dir: str):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


@functools.lru_cache(maxsize=None)
def hf_model(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: str):
    """generate()'s greedy tokens and per-step logits with the checkpoint's own EOS/pad."""
    return hf_generate(model_dir)


def hf_generate(model_dir: str, max_new: int = MAX_NEW, **kwargs):
    ids, mask = encode(model_dir)
    out = hf_model(model_dir).generate(
        ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def stages(model_dir: str, partition) -> list[StageExecutor]:
    return [StageExecutor(model_dir, start, end) for start, end in partition]


@pytest.mark.parametrize("partition", list(PARTITIONS), ids=list(PARTITIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_partitioned_greedy_tokens_equal_hf_generate(tiny_model_dirs, family, partition):
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    assert mask[:, 0].min() == 0 and mask.sum(1).unique().numel() == len(PROMPTS)  # padded, all lengths differ
    expected_tokens, expected_logits = hf_greedy(model_dir)

    result = generate_partitioned(
        stages(model_dir, PARTITIONS[partition]), ids, mask,
        SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2,), pad_token_id=0), keep_logits=True,
    )

    assert torch.equal(result.tokens, expected_tokens)
    torch.testing.assert_close(torch.stack(result.step_logits, dim=1), expected_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stops_at_eos_like_hf_generate(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    free = generate_partitioned(stages(model_dir, PARTITIONS["3-uneven"]), ids, mask,
                                SamplingParams(max_new_tokens=MAX_NEW))
    eos = int(free.tokens[0, 2])  # sequence 0 produces this at step 2 (or earlier)
    first_eos = int((free.tokens[0] == eos).nonzero()[0])
    expected, _ = hf_generate(model_dir, eos_token_id=eos, pad_token_id=0)

    stopped = generate_partitioned(stages(model_dir, PARTITIONS["3-uneven"]), ids, mask,
                                   SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(eos,), pad_token_id=0))

    assert torch.equal(stopped.tokens, expected)
    assert stopped.tokens[0, first_eos] == eos
    assert (stopped.tokens[0, first_eos + 1:] == 0).all()  # padded after its EOS
    finished_all = bool((stopped.tokens == eos).any(dim=1).all())
    assert stopped.tokens.shape[1] == (
        max(int((row == eos).nonzero()[0]) for row in stopped.tokens) + 1 if finished_all else MAX_NEW
    )


def test_generation_makes_exactly_max_new_tokens_without_eos(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    streamed = []
    result = generate_partitioned(stages(tiny_llama_dir, PARTITIONS["2-uneven"]), ids, mask,
                                  SamplingParams(max_new_tokens=7), on_step=lambda k, t: streamed.append((k, t)))
    assert result.tokens.shape == (len(PROMPTS), 7)
    assert [k for k, _ in streamed] == list(range(7))
    assert torch.equal(torch.stack([t for _, t in streamed], 1), result.tokens)
    assert result.tokens.dtype == torch.int64


def test_a_subclass_wrapping_decode_runs_once_a_step_outside_inference_mode(tiny_llama_dir):
    """``StageExecutor.decode`` enters inference mode itself where its caller has not (this reference loop):
    it runs its own step then, not ``self.decode`` again, so a technique's wrapper (which counts steps and opens
    their timeline spans) runs once a step; the tokens are generate()'s."""
    calls = []

    class Counted(StageExecutor):
        def decode(self, group, x):
            calls.append(torch.is_inference_mode_enabled())
            return super().decode(group, x)

    ids, mask = encode(tiny_llama_dir)
    result = generate_partitioned([Counted(tiny_llama_dir, a, b) for a, b in PARTITIONS["2-uneven"]], ids, mask,
                                  SamplingParams(max_new_tokens=MAX_NEW))
    assert calls == [False] * 2 * (MAX_NEW - 1)
    assert torch.equal(result.tokens, hf_greedy(tiny_llama_dir)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_is_reproducible_and_equal_across_partitionings(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=1234, max_new_tokens=8)
    runs = {name: generate_partitioned(stages(model_dir, PARTITIONS[name]), ids, mask, params).tokens
            for name in ("1-stage", "3-uneven", "4-head-alone")}
    again = generate_partitioned(stages(model_dir, PARTITIONS["1-stage"]), ids, mask, params).tokens
    other_seed = generate_partitioned(stages(model_dir, PARTITIONS["1-stage"]), ids, mask,
                                      SamplingParams(temperature=1.2, top_p=0.9, seed=99, max_new_tokens=8)).tokens
    greedy = generate_partitioned(stages(model_dir, PARTITIONS["1-stage"]), ids, mask,
                                  SamplingParams(max_new_tokens=8)).tokens

    assert torch.equal(runs["1-stage"], again)
    assert torch.equal(runs["1-stage"], runs["3-uneven"])
    assert torch.equal(runs["1-stage"], runs["4-head-alone"])
    assert not torch.equal(runs["1-stage"], other_seed)
    assert not torch.equal(runs["1-stage"], greedy)


def test_stage_outputs_hidden_states_then_last_position_logits(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    first, last = stages(tiny_llama_dir, PARTITIONS["2-uneven"])
    hidden = first.prefill(0, ids, mask)
    logits = last.prefill(0, hidden, mask)
    assert hidden.shape == (*ids.shape, first.hidden_size)
    assert logits.shape == (ids.shape[0], last.vocab_size) and logits.dtype == torch.float32
    step = last.decode(0, first.decode(0, logits.argmax(-1, keepdim=True)))
    assert step.shape == (ids.shape[0], last.vocab_size)
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    assert first.num_units == last.num_units == 6


def test_micro_batch_groups_keep_separate_caches(tiny_llama_dir):
    ids, mask = encode(tiny_llama_dir)
    (stage,) = stages(tiny_llama_dir, PARTITIONS["1-stage"])
    params = SamplingParams(max_new_tokens=MAX_NEW)
    alone_a = generate_partitioned([stage], ids[:2], mask[:2], params).tokens
    alone_b = generate_partitioned([stage], ids[2:], mask[2:], params).tokens

    # Interleave two groups step by step on one stage: each must match running alone.
    tokens_a = [stage.prefill(1, ids[:2], mask[:2]).argmax(-1)]
    tokens_b = [stage.prefill(2, ids[2:], mask[2:]).argmax(-1)]
    for _ in range(MAX_NEW - 1):
        tokens_b.append(stage.decode(2, tokens_b[-1][:, None]).argmax(-1))
        tokens_a.append(stage.decode(1, tokens_a[-1][:, None]).argmax(-1))

    assert torch.equal(torch.stack(tokens_a, 1), alone_a)
    assert torch.equal(torch.stack(tokens_b, 1), alone_b)
    assert stage.groups() == [1, 2]
    stage.drop(1)
    stage.drop(2)
    assert stage.groups() == []


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_decode_steps_build_the_padding_mask_only_where_it_is_transformers_own(tiny_model_dirs, family):
    """A one-token step's full-attention mask is the padding mask [B, 1, 1, T]: checked against
    transformers' mask factory at the first decode step, then built directly; the logits are
    bit-identical to building it with the factory every step (left padding included)."""
    import warnings

    ids, mask = encode(tiny_model_dirs[family])
    assert (mask == 0).any()  # left-padded rows: the mask is not all ones
    (fast,) = stages(tiny_model_dirs[family], PARTITIONS["1-stage"])
    (slow,) = stages(tiny_model_dirs[family], PARTITIONS["1-stage"])
    token = fast.prefill(0, ids, mask).argmax(-1, keepdim=True)
    assert torch.equal(slow.prefill(0, ids, mask).argmax(-1, keepdim=True), token)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the cache keyword transformers deprecates is not used
        for step in range(MAX_NEW):
            a = fast.decode(0, token)
            slow._decode_masks = DecodeMasks(shortcut=False)  # the factory at every step
            b = slow.decode(0, token)
            assert torch.equal(a, b)
            token = a.argmax(-1, keepdim=True)
    if "full_attention" in fast._layer_types:
        assert fast._decode_masks.seen[False] == "padding"


def test_an_unpadded_decode_step_gets_the_mask_transformers_gives_it_none_included():
    """Without padding transformers' factory answers a one-token step with None under sdpa, not
    an all-True mask; the shortcut learns that apart from the padded case (the staggered
    attention-offload replicas tell the two apart when they announce masks to memory agents)."""
    calls = []

    def factory(answer):
        def made():
            calls.append(answer)
            return answer
        return made

    masks = DecodeMasks()
    ones = torch.ones(1, 5, dtype=torch.int64)
    padded = torch.tensor([[0, 1, 1, 1, 1]])
    assert masks.mask(ones, factory(None)) is None
    assert masks.mask(ones, factory(None)) is None and calls == [None]  # learnt: not asked again
    as_padding = padded.bool()[:, None, None, :]
    assert torch.equal(masks.mask(padded, factory(as_padding)), as_padding)
    assert torch.equal(masks.mask(padded, factory("unused")), as_padding) and len(calls) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_repetition_penalty_and_an_ngram_ban_equals_hf_generate(tiny_model_dirs, family):
    """The penalty and the ban look at the padded prompt and every token so far, as HF's input_ids."""
    model_dir = tiny_model_dirs[family]
    ids, mask = encode(model_dir)
    for penalty, ngram in ((1.3, 0), (1.0, 2), (0.8, 3), (1.2, 2)):
        expected, _ = hf_generate(model_dir, max_new=16, repetition_penalty=penalty, no_repeat_ngram_size=ngram)
        got = generate_partitioned(stages(model_dir, PARTITIONS["3-uneven"]), ids, mask,
                                   SamplingParams(max_new_tokens=16, eos_token_ids=(2,), pad_token_id=0,
                                                  repetition_penalty=penalty, no_repeat_ngram_size=ngram))
        assert torch.equal(got.tokens, expected), (penalty, ngram)
    plain = generate_partitioned(stages(model_dir, PARTITIONS["3-uneven"]), ids, mask,
                                 SamplingParams(max_new_tokens=16, eos_token_ids=(2,), pad_token_id=0)).tokens
    assert not torch.equal(plain, got.tokens)  # the settings changed what greedy picks


def test_a_penalty_without_the_history_is_refused():
    from agents.sampling import sample

    with pytest.raises(ValueError, match="tokens so far"):
        sample(torch.zeros(1, 8), SamplingParams(repetition_penalty=1.2), torch.Generator())
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
