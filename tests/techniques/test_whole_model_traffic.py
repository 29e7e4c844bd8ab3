"""The test-only technique's own traffic (tests/techniques/whole_model_agent.py): a control message
and a data-frame kind of its own, strictly decoded by the shared decoders once registered, and
served for real by agent processes that load it with ``--technique-module`` /
``EDGESHARD_AGENT_TECHNIQUES`` — with no shared agent, core or gui module edited for it."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch
import zmq

from agents import registry
from agents.protocol import (
    DataHeader,
    Ok,
    PeerSpec,
    ProtocolError,
    decode_control,
    decode_data,
    encode_control,
    encode_data_header,
    options_of,
    options_slot,
)
from agents.transport import DATA_DOMAIN, CurveKeys, KeyGate, bind_port, curve_server, start_authenticator, tcp_address
from tests.techniques.whole_model_agent import AGENT_TECHNIQUE, STAGE_KIND, TOP_KIND, TopLogits, TopSpec

PEER = PeerSpec(device="asker", stage=0, data_address="tcp://127.0.0.1:5555", public_key="k" * 40)


@pytest.fixture
def registered():
    registry.register(AGENT_TECHNIQUE)
    yield AGENT_TECHNIQUE
    registry.unregister(AGENT_TECHNIQUE.name)


def test_its_message_is_decoded_strictly_and_range_checked_once_registered_and_unknown_before(registered):
    msg = TopLogits(req=3, request=7, input_ids=(1, 2, 3), k=4, send_to=PEER)
    assert decode_control(encode_control(msg)) == msg
    with pytest.raises(ProtocolError, match="whole_model_top_logits: request must be in .* and k in \\[1, 64\\]"):
        decode_control(encode_control(TopLogits(req=4, request=7, input_ids=(1,), k=0, send_to=PEER)))
    raw = msgspec.to_builtins(msg)
    with pytest.raises(ProtocolError, match="unknown field"):
        decode_control(msgspec.msgpack.encode({**raw, "extra": 1}))
    registry.unregister(AGENT_TECHNIQUE.name)
    with pytest.raises(ProtocolError) as refused:
        decode_control(encode_control(msg))
    assert refused.value.code == "bad_message" and refused.value.req == 3


def test_its_data_kind_carries_its_own_options_and_nothing_else(registered):
    spec = TopSpec(request=7, prompt_tokens=3)
    values = torch.arange(4, dtype=torch.float32)
    head = DataHeader(run_id="w", kind=TOP_KIND, phase="prefill", step=0, micro_batch=0, sender="box",
                      tensors=(), options=options_slot(spec))
    header, _ = decode_data([encode_data_header(head)], 1 << 20)
    assert header.kind == TOP_KIND and options_of(header.options) == spec
    bare = msgspec.structs.replace(head, options=options_slot(None))
    with pytest.raises(ProtocolError, match="whole-model-top frames carry TopSpec options"):
        decode_data([encode_data_header(bare)], 1 << 20)
    bad = msgspec.structs.replace(head, options=options_slot(TopSpec(request=7, prompt_tokens=0)))
    with pytest.raises(ProtocolError, match="prompt_tokens in \\[1, 4096\\]"):
        decode_data([encode_data_header(bad)], 1 << 20)
    hidden = msgspec.structs.replace(head, kind="hidden")
    with pytest.raises(ProtocolError, match="hidden frames carry no options"):
        decode_data([encode_data_header(hidden)], 1 << 20)
    registry.unregister(AGENT_TECHNIQUE.name)
    with pytest.raises(ProtocolError, match="not one this agent runs"):
        decode_data([encode_data_header(head)], 1 << 20)
    assert values.numel() == 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="llama", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5)
    return str(make_model(recipe, tmp_path_factory.mktemp("whole") / "tiny-llama"))


def test_agent_processes_load_it_run_its_stage_and_serve_its_message_and_data_kind(registered, model_dir,
                                                                                    tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from core.devices.local_cluster import LocalCluster
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import Coordinator, RunRequest
    from core.runs.generation import load_tokenizer
    from tests.core.hf_reference import hf_greedy_new_tokens

    monkeypatch.setenv(registry.TECHNIQUES_ENV, "tests.techniques.whole_model_agent")
    keys, gate = CurveKeys.generate(), KeyGate()
    ctx = zmq.Context()
    auth = start_authenticator(ctx, gate)
    pull = ctx.socket(zmq.PULL)
    try:
        curve_server(pull, keys, DATA_DOMAIN)
        port = bind_port(pull, "127.0.0.1", 0)
        with LocalCluster(tmp_path / "cluster", ["box"]) as cluster, \
                Coordinator(cluster.endpoints, cluster.keys) as co:
            co.wait_ready(60)
            gate.allow(DATA_DOMAIN, [cluster.endpoints[0].public_key])
            plan = plan_from_boundaries("tiny-llama", 3 + 2, ["box"], [])
            co.load(plan, model_dir, kind=STAGE_KIND, timeout_s=120)
            tok = load_tokenizer(model_dir)
            enc = tok(["the cat sat", "hello"], return_tensors="pt", padding=True)
            result = co.run(plan, RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                                             attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                                             max_new_tokens=4, eos_token_ids=(2,), pad_token_id=0))
            assert list(result.tokens) == hf_greedy_new_tokens(model_dir, enc, 4)

            prompt = tuple(tok("a longer prompt about the river")["input_ids"])
            asker = PeerSpec(device="asker", stage=0, data_address=tcp_address("127.0.0.1", port),
                             public_key=keys.public)
            reply = co.request("box", TopLogits(request=11, input_ids=prompt, k=5, send_to=asker), 60)
            assert isinstance(reply, Ok), reply
            assert pull.poll(30_000), "no whole-model-top frame arrived"
            header, bufs = decode_data(pull.recv_multipart(copy=False), 1 << 20)
    finally:
        pull.close(linger=0)
        auth.stop()
        ctx.destroy(linger=0)
    assert header.kind == TOP_KIND and header.sender == "box"
    assert options_of(header.options) == TopSpec(request=11, prompt_tokens=len(prompt))
    values = torch.frombuffer(bytearray(bufs[0]), dtype=torch.float32)
    ids = torch.frombuffer(bytearray(bufs[1]), dtype=torch.int64)
    with torch.inference_mode():  # the reference: transformers' own forward of the unsplit model
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        expected = torch.topk(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), 5)
    assert torch.equal(ids, expected.indices) and torch.allclose(values, expected.values, atol=1e-5)


@pytest.mark.parametrize(("module", "why"), [
    ("no_such_package.techniques", "cannot import technique module 'no_such_package.techniques': ModuleNotFoundError"),
    ("json", "technique module 'json' defines no AGENT_TECHNIQUE"),
    ("tests.techniques; rm -rf", "is not a Python module name"),
])
def test_an_agent_refuses_to_start_with_a_technique_module_it_cannot_load(module, why):
    proc = subprocess.run([sys.executable, "-m", "agents", "serve", f"--coordinator-key={CurveKeys.generate().public}",
                           "--host", "127.0.0.1", "--technique-module", module],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
