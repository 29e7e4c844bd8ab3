"""A run's traffic from the agents' own counters (real agent processes): each decode step adds one
hidden frame on the link between the two stages, of the activation's bytes plus one header; the
prediction counts the same frames, headers included."""

from __future__ import annotations

import pytest

from core.devices.local_cluster import LocalCluster
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import Coordinator
from core.runs.run_stream import RunRequest
from core.runs.wire import WireTraffic, sent_between, snapshot

HIDDEN = 64


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    recipe = ModelRecipe(family="llama", layers=4, hidden=HIDDEN, heads=4, kv_heads=2, vocab=512, seed=7)
    return str(make_model(recipe, tmp_path_factory.mktemp("wire") / "tiny-llama"))


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory, tiny_llama_dir):
    """Two agent processes with a 2-stage plan of the tiny Llama loaded (one set-up for the module)."""
    plan = plan_from_boundaries("tiny", 6, ["a", "b"], [3])
    with LocalCluster(tmp_path_factory.mktemp("agents"), ["a", "b"]) as cluster, \
            Coordinator(cluster.endpoints, cluster.keys) as co:
        co.wait_ready(30)
        co.load(plan, tiny_llama_dir, timeout_s=60)
        yield plan, co


def _run(co, plan, prompt, new):
    request = RunRequest(input_ids=prompt, attention_mask=tuple((1,) * len(p) for p in prompt), max_new_tokens=new)
    before = snapshot(co.status_of(["a", "b"]))
    result = co.run(plan, request)
    return result, sent_between(before, snapshot(co.status_of(["a", "b"])))


def test_each_extra_decode_step_adds_one_activation_and_one_header_on_the_stage_link(two_stages):
    plan, co = two_stages
    prompt = ((5, 17, 33, 9), (8, 8, 40, 2))
    (_, short), (_, long) = (_run(co, plan, prompt, new) for new in (2, 7))
    extra = long.sent[("a", "b", "hidden")][1] - short.sent[("a", "b", "hidden")][1]
    assert long.sent[("a", "b", "hidden")][0] - short.sent[("a", "b", "hidden")][0] == 5
    header = extra / 5 - 2 * HIDDEN * 4  # batch 2, one new position, float32
    assert 60 < header < 400
    assert long.nbytes(kinds=["hidden"]) == long.sent[("a", "b", "hidden")][1]  # only a sends activations


def test_the_prediction_with_frame_headers_and_the_prefill_mask_is_what_the_sockets_sent_on_each_link(
        two_stages, tiny_llama_dir):
    from core.models.units import load_model_spec
    from core.runs.wire import predicted_stage_bytes

    plan, co = two_stages
    result, sent = _run(co, plan, ((5, 17, 33, 9, 11), (8, 8, 40, 2, 3), (1, 2, 3, 4, 5)), 9)
    predicted = predicted_stage_bytes(load_model_spec(tiny_llama_dir, "fp32"), plan, 5, result.token_events, result.run_id)
    measured = {("a", "b"): sent.nbytes(senders=["a"], links=["b"]), ("b", "a"): sent.nbytes(senders=["b"], links=["a"])}
    assert predicted == measured  # byte for byte: 9 steps of 3 rows, tokens back, no header modelled by hand


def test_a_counter_that_restarted_with_its_agent_counts_from_zero():
    before = WireTraffic({("a", "b", "hidden"): (10, 1000)})
    after = WireTraffic({("a", "b", "hidden"): (3, 300)})
    assert sent_between(before, after).sent == {("a", "b", "hidden"): (3, 300)}


def test_wire_figures_count_agent_to_agent_bytes_beside_the_prediction_and_control_bytes_apart():
    from core.runs.wire import wire_figures

    traffic = WireTraffic({("a", "b", "hidden"): (4, 1100), ("b", "a", "tokens"): (4, 300),
                           ("a", "coordinator", "status"): (2, 500), ("b", "c", "hidden"): (1, 99)})
    wire = wire_figures(traffic, ["a", "b"], {("a", "b"): 1000, ("b", "a"): 32})
    assert (wire["measured_bytes"], wire["predicted_bytes"], wire["control_bytes"]) == (1400, 1032, 500)
    assert wire["per_link"] == {"a->b": {"measured": 1100, "predicted": 1000}, "b->a": {"measured": 300, "predicted": 32}}
    assert wire["measured_over_predicted"] == round(1400 / 1032, 4)
    only = wire_figures(traffic, ["a", "b"], None, kinds=["hidden"], predicted_total=1000)
    assert (only["measured_bytes"], only["measured_over_predicted"]) == (1100, 1.1)
    assert wire_figures(None, ["a"], None)["measured_bytes"] is None


def test_a_layer_sharded_runs_prediction_counts_the_prefill_positions_and_each_decode_step():
    from agents.protocol import TokenEvent
    from core.models.units import model_spec_from_config
    from core.runs.wire import frame_header_bytes, predicted_stage_bytes

    spec = model_spec_from_config({"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 4,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                   "vocab_size": 512}, "fp32")
    plan = plan_from_boundaries("tiny", 6, ["a", "b"], [3])
    tokens = [TokenEvent(micro_batch=0, step=s, sequence_ids=(0, 1), token_ids=(1, 1), t_s=s) for s in range(3)]
    predicted = predicted_stage_bytes(spec, plan, 5, tokens, "3f9a0c1b2d4e")
    frame = lambda kind, step, *tensors: frame_header_bytes(  # noqa: E731
        kind=kind, phase="prefill" if step == 0 else "decode", step=step, micro_batch=0,
        sender="a" if kind == "hidden" else "b", tensors=tensors, run_id="3f9a0c1b2d4e")
    hidden = [frame("hidden", 0, ("float32", (2, 5, HIDDEN)), ("int64", (2, 5)))] + [
        frame("hidden", s, ("float32", (2, 1, HIDDEN))) for s in (1, 2)]
    # 2 rows: the 5-position prefill with its mask, 2 decode steps; each frame with its header
    assert predicted[("a", "b")] == 2 * (5 + 2) * HIDDEN * 4 + 2 * 5 * 8 + sum(hidden)
    tokens = [frame("tokens", s, ("int64", (2,))) for s in range(3)]
    assert predicted[("b", "a")] == 2 * 3 * spec.units[-1].activation_bytes_per_token + sum(tokens)  # each step's token back


def test_a_frame_header_is_the_encoded_header_an_agent_sends():
    from agents.protocol import DataHeader, TensorSpec, encode_data_header
    from core.runs.wire import frame_header_bytes

    sent = DataHeader(run_id="3f9a0c1b2d4e", kind="hidden", phase="decode", step=300, micro_batch=1, sender="local-0",
                      tensors=(TensorSpec("float32", (2, 1, 64)),), t_sent=1733550000.123)
    assert frame_header_bytes(kind="hidden", phase="decode", step=300, micro_batch=1, sender="local-0",
                              tensors=[("float32", (2, 1, 64))], run_id="3f9a0c1b2d4e") == len(encode_data_header(sent))
