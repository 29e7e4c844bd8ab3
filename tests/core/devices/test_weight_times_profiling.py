"""Each device's own decoder-block time at int8/int4 over fp (``edgeshard profile --weight-times``): the
agent's profiler quantizes the block as a stage at that precision holds it (torchao, the stage's own
configs) before timing it, and the profile carries one ratio per device and precision."""

from __future__ import annotations

import math

import pytest

from agents.profiler import profile_units
from agents.protocol import ComputeOptions

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _block(weights: str):
    return profile_units(ComputeOptions(config=TINY, prompt_tokens=8, batch_sizes=(1,), repeats=2, warmup=1,
                                        threads=1, units=(1,), headroom_bytes=1 << 20, weights=weights)).units[0]


def test_a_block_timed_at_int8_or_int4_holds_the_bytes_a_stage_at_that_precision_holds():
    from core.models.units import model_spec_from_config
    from core.planning.precision import unit_weight_bytes

    block = model_spec_from_config(TINY, dtype="fp32").units[1]
    for w in ("fp", "int8", "int4"):
        assert _block(w).param_bytes == unit_weight_bytes(block, w, "fp32"), w


def test_a_precision_the_model_cannot_be_quantized_to_is_refused_before_any_unit_is_built():
    gpt2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    with pytest.raises(ValueError, match="int8 weights are supported for llama"):
        profile_units(ComputeOptions(config=gpt2, weights="int8"))


def test_profiling_with_weight_times_writes_each_devices_own_ratios_and_the_planner_reads_them(tmp_path):
    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core.devices.profiling import profile_cluster
    from core.planning.precision import time_ratio
    from core.runs.coordinator import AgentEndpoint, Coordinator

    keys = CurveKeys.generate()
    agent = Agent("dev-a", keys.public).start()
    try:
        with Coordinator([AgentEndpoint(agent.device, agent.control_address, agent.keys.public)], keys,
                         heartbeat_timeout_s=60.0) as co:  # in-process agents share the GIL with profiling
            profile = profile_cluster(co, TINY, model_name="tiny", prompt_tokens=8, batch_sizes=(1,), repeats=2,
                                      headroom_bytes=1 << 20, threads=1, network=False,
                                      weight_times=("int8", "int4")).profile
    finally:
        agent.close()
    own = {(t.device, t.weights): t for t in profile.precision_times}
    assert sorted(own) == [("dev-a", "int4"), ("dev-a", "int8")]
    for t in own.values():
        # timings of a tiny block on a shared host: only that they are measured (int4 took 106x once at load 16)
        assert 0 < t.decode_time_ratio < math.inf and 0 < t.prefill_time_ratio < math.inf
        assert time_ratio(profile, t.weights, "decode", "dev-a") == t.decode_time_ratio


@pytest.mark.parametrize("given, said", [("int3", "weight times are profiled at int8 and/or int4, not int3"),
                                         ("int8", "weight times: int8 weights are supported for llama")])
def test_edgeshard_profile_refuses_weight_times_it_cannot_take_before_asking_any_agent(tmp_path, capsys, given, said):
    import json

    from core.cli import main

    model = dict(TINY) if given == "int3" else dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4,
                                                    vocab_size=256, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(model))
    rc = main(["profile", "--agents", str(tmp_path / "no-agents.json"), "--model", str(tmp_path),
               "--out", str(tmp_path / "p.json"), "--weight-times", given])
    assert rc == 2 and said in capsys.readouterr().err
