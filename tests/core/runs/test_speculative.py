"""Greedy speculative decoding over agent processes (``core.runs.speculative``): the tokens are plain
greedy decoding's and transformers' (``generate`` and assisted ``generate(assistant_model=)``), for
2 and 3 stages and several k, with a draft the target mostly rejects and one it always accepts."""

from __future__ import annotations

import pytest
import torch

from core.devices.local_cluster import LocalCluster
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import Coordinator
from core.runs.generation import GenerationSettings, load_plan
from core.runs.run_stream import RunRequest
from core.runs.speculative import (
    DraftMismatch,
    acceptance_rate,
    check_draft,
    speculative_request,
    stage_caches,
    trips,
)

DEVICES = ["spec-a", "spec-b", "spec-c"]
PROMPT = (5, 17, 99, 3, 250, 11)
NEW = 12
BOUNDS = {2: [3], 3: [2, 4]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    shape = dict(family="llama", hidden=64, heads=4, kv_heads=2, vocab=512)
    target = make_model(ModelRecipe(layers=4, seed=3, **shape), root / "target")
    draft = make_model(ModelRecipe(layers=1, seed=5, **shape), root / "draft")
    return root, str(target), str(draft)


@pytest.fixture(scope="module")
def cluster(models):
    root = models[0]
    with LocalCluster(root / "cluster", DEVICES) as c, Coordinator(c.endpoints, c.keys) as coord:
        yield coord


@pytest.fixture(scope="module")
def hf_models(models):
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(d).eval() for d in models[1:])


@pytest.fixture(scope="module")
def references(hf_models):
    target, draft = hf_models
    args = dict(input_ids=torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    plain = target.generate(**args)[0, len(PROMPT):].tolist()
    assisted = target.generate(**args, assistant_model=draft)[0, len(PROMPT):].tolist()
    return plain, assisted


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def loaded(request, cluster, models):
    n = request.param
    plan = plan_from_boundaries("target", 6, DEVICES[:n], BOUNDS[n])
    load_plan(cluster, plan, models[1], GenerationSettings(threads=1))
    plain = cluster.run(plan, RunRequest(input_ids=(PROMPT,), attention_mask=((1,) * len(PROMPT),),
                                         max_new_tokens=NEW)).tokens[0]
    return cluster, plan, plain


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("which", ["rejected-draft", "accepted-draft"])
def test_speculative_greedy_tokens_equal_plain_decoding_and_transformers(loaded, models, references, k, which):
    coord, plan, plain = loaded
    draft = models[2] if which == "rejected-draft" else models[1]  # the target drafting for itself: all accepted
    result = coord.run(plan, speculative_request(PROMPT, NEW, check_draft(models[1], draft, k)))
    assert list(result.tokens[0]) == list(plain) == references[0] == references[1]
    rate = acceptance_rate(result, k, NEW)
    if which == "accepted-draft":
        assert rate == 1.0 and trips(result) == -(-(NEW - 1) // (k + 1))  # k+1 tokens a trip
    else:  # rejected proposals were rolled back on every stage's agent, and the tokens still equal plain's
        assert rate is not None and rate < 1.0
        rolled = {e.device for e in result.events if e.kind == "rollback" and e.nbytes > 0}
        assert rolled == {s.device for s in plan.stages}
    drafts = [e for e in result.events if e.kind == "draft"]
    assert len(drafts) == trips(result) and {e.device for e in drafts} == {plan.stages[0].device}


def test_a_draft_on_another_stage_gives_plain_decodings_and_transformers_greedy_tokens(loaded, models, references):
    from dataclasses import replace

    coord, plan, plain = loaded
    source, drafter = plan.stages[0].device, plan.stages[1].device  # 2 stages: the last; 3: the middle one
    settings = replace(check_draft(models[1], models[2], 3), draft_device=drafter)
    result = coord.run(plan, speculative_request(PROMPT, NEW, settings))
    assert list(result.tokens[0]) == list(plain) == references[0] == references[1]
    drafts = [e for e in result.events if e.kind == "draft"]  # a last trip left no room to propose: no ask
    assert trips(result) - 1 <= len(drafts) <= trips(result) and {e.device for e in drafts} == {drafter}
    hops = {(e.device, e.peer) for e in result.events if e.kind == "send" and e.phase == "decode"}
    assert {(source, drafter), (drafter, source)} <= hops  # the committed tokens to it, its proposals back


CACHE_ATOL = 1e-5
"""A stage's cached keys/values against transformers' one forward over the same tokens: the agents
computed them in pieces (the prompt, then trips of up to k+1 positions) where the reference runs
every position at once, so each row's matmuls sum in another order (float32: ~1e-7 apart here,
what plain decoding over the agents differs by too); a stale or misplaced position differs by O(1)."""


def test_a_rejected_run_of_proposals_leaves_every_stage_agents_cache_as_plain_decoding(loaded, models, hf_models):
    coord, plan, plain = loaded
    result = coord.run(plan, speculative_request(PROMPT, NEW, check_draft(models[1], models[2], 3), keep_cache=True))
    tokens = list(result.tokens[0])
    assert tokens == list(plain)
    rolled = {e.device for e in result.events if e.kind == "rollback" and e.nbytes > 0}
    assert rolled == {s.device for s in plan.stages}  # every stage rewound rejected proposals on the way
    with torch.inference_mode():  # the independent reference: transformers' cache over the same tokens
        reference = hf_models[0](input_ids=torch.tensor([[*PROMPT, *tokens]]), use_cache=True).cache
        wrong = hf_models[0](input_ids=torch.tensor([[*PROMPT, *tokens[:-1], (tokens[-1] + 1) % 512]]),
                             use_cache=True).cache  # the last position a rejected proposal's
    seen = []
    for device, (length, layers) in stage_caches(coord, plan).items():
        assert length == len(PROMPT) + len(tokens), device
        for i, (keys, values) in layers.items():
            torch.testing.assert_close(keys, reference.layers[i].keys, rtol=0, atol=CACHE_ATOL)
            torch.testing.assert_close(values, reference.layers[i].values, rtol=0, atol=CACHE_ATOL)
            assert float((values - wrong.layers[i].values)[..., -1, :].abs().max()) > 100 * CACHE_ATOL
            seen.append(i)
    assert sorted(seen) == [0, 1, 2, 3]  # every block of the target, each on one stage


def test_a_stage_cache_is_read_only_by_the_coordinator_whose_stage_it_is(loaded, cluster):
    from core.errors import EdgeShardError

    coord, plan, _ = loaded
    with Coordinator(list(coord.endpoints.values()), coord.keys) as other, pytest.raises(EdgeShardError, match="read only by the coordinator"):
        stage_caches(other, plan)


def test_an_agent_times_the_draft_proposing_as_a_runs_source_does(cluster, models):
    from core.devices.profiling import ProfilingFailed, time_draft

    timed = time_draft(cluster, DEVICES[0], models[2], threads=1)
    assert timed.device == DEVICES[0] and timed.draft == "draft" and 0 < timed.token_s < 1.0
    with pytest.raises(ProfilingFailed, match=f"{DEVICES[1]}: timing the draft failed"):
        time_draft(cluster, DEVICES[1], models[0] / "no-such-draft")


def test_a_draft_of_another_vocabulary_tokenizer_or_a_bad_k_is_refused_at_the_entrance(models, tmp_path):
    import json
    import shutil
    from pathlib import Path

    other = tmp_path / "other"
    shutil.copytree(models[2], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    with pytest.raises(DraftMismatch, match="vocabulary of 256 tokens, the target 512"):
        check_draft(models[1], other, 3)
    (other / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((Path(models[2]) / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: the same size, another meaning
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftMismatch, match="tokenizer differs"):
        check_draft(models[1], other, 3)
    with pytest.raises(DraftMismatch, match=r"--speculate must be in \[1, 64\], got 0"):
        check_draft(models[1], models[2], 0)
    with pytest.raises(DraftMismatch, match="no config.json"):
        check_draft(models[1], tmp_path, 3)


TEMPERATURE = 1.0


def reference_speculative_sampling(target, draft, prompt, k, new, seed):
    """Speculative sampling as the paper writes it (Leviathan et al. 2023, algorithm 1), in process
    over transformers' full forwards, with the run's draws: per trip ``step_generator(seed, 0, trip)``
    gives the draft's k draws, then per proposal one uniform, then at most one token."""
    from agents.sampling import step_generator

    def probs(model, ids):
        return torch.softmax(model(input_ids=torch.tensor([ids])).logits[0].float() / TEMPERATURE, -1)

    with torch.inference_mode():
        out = [int(torch.multinomial(probs(target, prompt)[-1], 1, generator=step_generator(seed, 0, 0)))]
        trip = 0
        while len(out) < new:
            trip += 1
            gen = step_generator(seed, 0, trip)
            xs, qs = [], []
            for _ in range(min(k, new - len(out) - 1)):
                q = probs(draft, [*prompt, *out, *xs])[-1]
                xs.append(int(torch.multinomial(q, 1, generator=gen)))
                qs.append(q)
            p = probs(target, [*prompt, *out, *xs])[len(prompt) + len(out) - 1:]
            for i, x in enumerate(xs):
                if float(torch.rand((), generator=gen)) < min(1.0, float(p[i, x] / qs[i][x])):
                    out.append(x)
                    continue
                residual = torch.clamp(p[i] - qs[i], min=0)
                out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=gen)))
                break
            else:
                out.append(int(torch.multinomial(p[len(xs)], 1, generator=gen)))
    return out[:new]


@pytest.fixture(scope="module")
def sampled(cluster, models):
    """Seeded speculative sampling on 3 stages: two runs of seed 11, one of seed 12, and one of seed
    11 with the draft on the last stage's device."""
    from dataclasses import replace

    from agents.protocol import SamplingSpec

    plan = plan_from_boundaries("target", 6, DEVICES, BOUNDS[3])
    load_plan(cluster, plan, models[1], GenerationSettings(threads=1))
    spec = check_draft(models[1], models[2], 3)
    far = replace(spec, draft_device=DEVICES[2])
    runs = {}
    for name, seed, settings in (("first", 11, spec), ("again", 11, spec), ("other", 12, spec), ("far", 11, far)):
        runs[name] = cluster.run(plan, speculative_request(PROMPT, NEW, settings, sampling=SamplingSpec(
            temperature=TEMPERATURE, seed=seed)))
    return runs


def test_seeded_speculative_sampling_over_agents_is_reproducible(sampled):
    assert list(sampled["first"].tokens[0]) == list(sampled["again"].tokens[0]) == list(sampled["far"].tokens[0])
    assert list(sampled["first"].tokens[0]) != list(sampled["other"].tokens[0])
    assert len(sampled["first"].tokens[0]) == NEW


def test_speculative_sampling_over_agents_draws_what_the_papers_rule_draws_in_process(sampled, models):
    from transformers import AutoModelForCausalLM

    target, draft = (AutoModelForCausalLM.from_pretrained(d).eval() for d in models[1:])
    assert list(sampled["first"].tokens[0]) == reference_speculative_sampling(target, draft, list(PROMPT), 3, NEW, 11)
    assert list(sampled["far"].tokens[0]) == list(sampled["first"].tokens[0])  # a draft elsewhere draws the same
    assert {e.device for e in sampled["far"].events if e.kind == "draft"} == {DEVICES[2]}
    assert list(sampled["other"].tokens[0]) == reference_speculative_sampling(target, draft, list(PROMPT), 3, NEW, 12)
    assert 1 < trips(sampled["first"]) < NEW - 1  # proposals were both accepted and rejected on the way
