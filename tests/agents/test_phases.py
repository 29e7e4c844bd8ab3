"""EPD's phase executors in one process: encode → prefill → decode gives generate()'s tokens,
split tiles (IRP) give the same tokens, each executor reads only its part, bad requests are
refused by name, and phase messages carry only checked raw bytes."""

from __future__ import annotations

import pytest
import torch
import transformers

from agents.techniques.phase_disaggregation.phases import (
    DecodeExecutor,
    EncodeExecutor,
    PhaseRequestError,
    PrefillExecutor,
    to_bytes,
)
from agents.protocol import ProtocolError, SamplingSpec, decode_control, encode_control
from agents.techniques.phase_disaggregation.messages import DecodeTokens, EncodeTiles, PrefillPrompt
from agents.sampling import SamplingParams
from core.models.multimodal import TINY_LLAVA, check_multimodal_dir, load_image, make_multimodal_model, prompt_ids, \
    synthetic_images


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = make_multimodal_model(TINY_LLAVA, tmp_path_factory.mktemp("llava") / "m")
    info = check_multimodal_dir(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tiles = load_image(synthetic_images()[0], info.tile, 4)
    ids = prompt_ids(tok, "Describe the picture.", 4, info)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(path)).eval()
    return path, info, tiles, ids, model


@pytest.fixture(scope="module")
def executors(llava):
    path = str(llava[0])
    return EncodeExecutor(path), PrefillExecutor(path), DecodeExecutor(path)


def _generate(model, ids, tiles, n, **kw):
    model.generation_config.eos_token_id = None
    out = model.generate(input_ids=torch.tensor([ids]), pixel_values=tiles, max_new_tokens=n, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def _phases(executors, info, ids, tiles, params, irp=1):
    enc, pre, dec = executors
    pieces = torch.tensor_split(torch.arange(tiles.shape[0]), irp)
    mm = torch.cat([enc.encode(tiles[p]) for p in pieces]).reshape(-1, info.hidden)
    g = params.make_generator()
    first, kv = pre.prefill_prompt(ids, mm, params, g)
    moved = torch.Generator()
    moved.set_state(torch.frombuffer(bytearray(g.get_state().numpy().tobytes()), dtype=torch.uint8))
    rest, _ = dec.decode_tokens(kv, first, params.max_new_tokens, params, moved)
    return [first, *rest]


@pytest.mark.parametrize("irp", [1, 2, 4])
def test_encode_prefill_decode_gives_generates_greedy_tokens_however_tiles_are_split(llava, executors, irp):
    path, info, tiles, ids, model = llava
    ref = _generate(model, ids, tiles, 10, do_sample=False)
    assert _phases(executors, info, ids, tiles, SamplingParams(max_new_tokens=10), irp) == ref


def test_seeded_sampling_across_the_phases_gives_generates_tokens(llava, executors):
    path, info, tiles, ids, model = llava
    torch.manual_seed(11)
    ref = _generate(model, ids, tiles, 10, do_sample=True, temperature=0.9, top_k=50, top_p=0.9)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=11, max_new_tokens=10)
    assert _phases(executors, info, ids, tiles, params) == ref


def test_the_encode_executor_reads_only_the_vision_tower_and_projector(llava):
    from agents.techniques.phase_disaggregation import phases

    reads = []
    original = phases.CheckpointReader.read

    def spy(self, names, dtype):
        reads.extend(names)
        return original(self, names, dtype)

    phases.CheckpointReader.read = spy
    try:
        enc = EncodeExecutor(str(llava[0]))
    finally:
        phases.CheckpointReader.read = original
    assert reads and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in reads)
    assert enc.memory_bytes() < PrefillExecutor(str(llava[0])).memory_bytes()


def test_multimodal_tokens_that_do_not_fill_the_prompts_image_slots_are_refused(llava, executors):
    _, info, tiles, ids, _ = llava
    mm = executors[0].encode(tiles[:2]).reshape(-1, info.hidden)  # 2 tiles for a 4-tile prompt
    with pytest.raises(PhaseRequestError, match="64 <image> tokens"):
        executors[1].prefill_prompt(ids, mm, SamplingParams(), torch.Generator())


def test_tiles_of_the_wrong_size_are_refused_naming_the_size(executors):
    with pytest.raises(PhaseRequestError, match=r"N×3×32×32"):
        executors[0].serve(EncodeTiles(request=0, tiles=(0,), shape=(1, 3, 16, 16),
                                       data=to_bytes(torch.zeros(1, 3, 16, 16))))


def test_a_kv_cache_of_another_geometry_is_refused(executors):
    kv = torch.zeros(1, 2, 2, 5, 16)
    with pytest.raises(PhaseRequestError, match="KV cache must be"):
        executors[2].serve(DecodeTokens(request=0, first_token=5, kv_shape=tuple(kv.shape), kv=to_bytes(kv),
                                        max_new_tokens=3))


def test_a_phase_executor_refuses_another_phases_request(executors):
    with pytest.raises(PhaseRequestError, match="serves encode_tiles"):
        executors[0].serve(PrefillPrompt(request=0, input_ids=(1, 2)))


@pytest.mark.parametrize("msg, problem", [
    (EncodeTiles(request=0, tiles=(0,), shape=(1, 3, 32, 32), data=b"\0" * 12), "holds 12 bytes"),
    (EncodeTiles(request=0, tiles=(0, 1), shape=(1, 3, 2, 2), data=b"\0" * 48), "one tile index"),
    (PrefillPrompt(request=0, input_ids=(1,), mm_shape=(2, 4), mm=b"\0" * 8), "holds 8 bytes"),
    (PrefillPrompt(request=0, input_ids=(1,), sampling=SamplingSpec(top_p=0.0)), "top_p"),
    (DecodeTokens(request=0, first_token=1, kv_shape=(1, 2, 1, 1, 1), kv=b"\0" * 8, max_new_tokens=0), "max_new"),
    (DecodeTokens(request=0, first_token=1, kv_shape=(1, 2, 1, 1, 1), kv=b"\0" * 8, max_new_tokens=2,
                  rng=b"\0" * 20000), "rng"),
])
def test_phase_messages_whose_fields_do_not_fit_are_refused_at_decode(msg, problem):
    with pytest.raises(ProtocolError, match=problem):
        decode_control(encode_control(msg))


def test_a_well_formed_phase_message_round_trips():
    msg = EncodeTiles(request=3, tiles=(0, 1), shape=(2, 3, 2, 2), data=b"\0" * 96)
    assert decode_control(encode_control(msg)) == msg


class _AgentSide:
    """What PhaseLinks uses of an agent: its data socket (a real PULL, plain TCP here), clock and log."""

    def __init__(self, device="p"):
        import time

        import zmq

        self.device, self.clock, self.lines = device, time.time, []
        self.wire = None  # no wire counts
        self.context = zmq.Context.instance()
        self.data_socket = self.context.socket(zmq.PULL)
        self.data_socket.rcvtimeo = 50
        self.port = self.data_socket.bind_to_random_port("tcp://127.0.0.1")
        self.keys, self.default_link = None, None

    def log(self, line):
        self.lines.append(line)


def _peers(agent):
    from agents.protocol import PeerSpec

    return [PeerSpec(device="e", stage=0, data_address="tcp://127.0.0.1:1", public_key="k" * 40),
            PeerSpec(device=agent.device, stage=1, data_address=f"tcp://127.0.0.1:{agent.port}", public_key="k" * 40)]


def test_pieces_that_never_arrive_fail_the_request_naming_them():
    from agents.techniques.phase_disaggregation.phases import PhaseLinks

    agent = _AgentSide()
    links = PhaseLinks(agent, _peers(agent))
    with pytest.raises(PhaseRequestError, match=r"mm pieces \[0, 1\] of request 7 did not arrive"):
        links.take("mm", "", 7, (0, 1), timeout_s=0.2)
    agent.data_socket.close(linger=0)


def test_a_piece_from_a_device_outside_the_pools_is_dropped_and_logged():
    import zmq

    from agents.techniques.phase_disaggregation.phases import PhaseLinks
    from agents.protocol import DataHeader
    from agents.transport import data_message, tensor_frame

    agent = _AgentSide()
    links = PhaseLinks(agent, _peers(agent))
    push = agent.context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{agent.port}")
    spec, buf = tensor_frame(torch.zeros(2, 4))
    for sender in ("stranger", "e"):
        header = DataHeader(run_id="epd", kind="mm", phase="prefill", step=7, micro_batch=0, sender=sender,
                            tensors=(spec,))
        push.send_multipart(data_message(header, [buf]))
    got = links.take("mm", "", 7, (0,), timeout_s=30.0)
    assert tuple(got[0][0].shape) == (2, 4) and any("stranger" in line for line in agent.lines)
    push.close(linger=0)
    agent.data_socket.close(linger=0)


def test_a_failed_runs_stale_piece_never_feeds_the_next_runs_request_of_the_same_index():
    import zmq

    from agents.techniques.phase_disaggregation.phases import PhaseLinks
    from agents.protocol import DataHeader
    from agents.transport import data_message, tensor_frame

    agent = _AgentSide()
    links = PhaseLinks(agent, _peers(agent))
    push = agent.context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{agent.port}")

    def piece(run: str, value: float) -> None:
        spec, buf = tensor_frame(torch.full((2, 4), value))
        push.send_multipart(data_message(DataHeader(run_id=run, kind="mm", phase="prefill", step=7, micro_batch=0,
                                                    sender="e", tensors=(spec,)), [buf]))

    links.begin("")  # a profiling probe first (it names no run)
    links.begin("run-a")
    piece("run-a", 1.0)  # run a fails before its request 7 takes this piece
    while links.receive(200):
        pass
    links.begin("run-b")
    assert links.held_bytes == 0  # dropped when run b began
    piece("run-a", 1.0)  # a late piece of the failed run
    piece("run-b", 2.0)
    got = links.take("mm", "run-b", 7, (0,), timeout_s=30.0)
    assert float(got[0][0][0, 0]) == 2.0
    while links.receive(200):
        pass
    assert not links.held and any("stale" in line for line in agent.lines)
    piece("epd", 3.0)  # a probe that names no run (profiling), after named runs: kept, then taken
    got = links.take("mm", "", 7, (0,), timeout_s=30.0)
    assert float(got[0][0][0, 0]) == 3.0
    push.close(linger=0)
    agent.data_socket.close(linger=0)


def test_data_plane_phase_messages_must_not_also_carry_the_bytes():
    msg = DecodeTokens(request=0, first_token=1, kv_shape=(1, 2, 1, 1, 1), kv=b"\0" * 8, max_new_tokens=2,
                       kv_from="p")
    with pytest.raises(ProtocolError, match="no kv bytes"):
        decode_control(encode_control(msg))
    msg = PrefillPrompt(request=0, input_ids=(1,), mm_shape=(1, 4), mm=b"\0" * 16, mm_pieces=(0,))
    with pytest.raises(ProtocolError, match="mm_pieces"):
        decode_control(encode_control(msg))


def test_the_first_token_and_sampler_state_travel_exactly_beside_the_kv_cache_and_a_bad_handoff_is_refused():
    from agents.techniques.phase_disaggregation.phases import from_handoff, handoff_tensor

    gen = torch.Generator().manual_seed(5)
    torch.rand(7, generator=gen)
    rng = gen.get_state().numpy().tobytes()
    assert from_handoff(handoff_tensor(123_456, rng)) == (123_456, rng)
    assert from_handoff(handoff_tensor(7, b"\x01\x02\x03")) == (7, b"\x01\x02\x03")  # not a multiple of 4
    assert from_handoff(handoff_tensor(9, b"")) == (9, b"")
    for bad in (torch.tensor([1.5, 3.0]), torch.tensor([1.0, 300.0]), torch.tensor([-1.0]), torch.empty(0),
                torch.tensor([1.0, 4.0])):
        with pytest.raises(PhaseRequestError, match="handoff is not a token and sampler-state bytes"):
            from_handoff(bad)


def test_the_handoff_carries_the_sampler_state_at_its_own_size_not_four_bytes_a_byte():
    """The KV link measured 2.08x the cost model's KV bytes: the 5,056-byte CPU generator state travelled
    as one float32 per byte (20,228 B a request, more than the tiny model's 18,944-B KV cache)."""
    from agents.techniques.phase_disaggregation.phases import handoff_tensor

    rng = torch.Generator().manual_seed(5).get_state().numpy().tobytes()
    assert len(rng) == 5056
    assert handoff_tensor(3, rng).numel() * 4 == 4 + 4 + 5056  # token, state length, the state
    assert handoff_tensor(3, b"").numel() * 4 == 8


def test_a_greedy_prefill_sends_no_sampler_state_and_a_sampled_one_sends_its_generators(llava, executors):
    """Greedy never draws from the generator: decode's own, made from the seed, is the same state."""
    from agents.techniques.phase_disaggregation.messages import PrefillPrompt
    from agents.techniques.phase_disaggregation.phases import sampling_params

    path, info, tiles, ids, _ = llava
    mm = executors[0].encode(tiles).reshape(-1, info.hidden)
    for spec in (SamplingSpec(), SamplingSpec(temperature=0.9, top_k=50, seed=4)):
        msg = PrefillPrompt(request=0, input_ids=tuple(ids), sampling=spec, mm_shape=tuple(mm.shape), mm=to_bytes(mm))
        reply = executors[1].serve(msg)
        g = sampling_params(spec, 1).make_generator()
        executors[1].prefill_prompt(ids, mm, sampling_params(spec, 1), g)
        assert reply.rng == (g.get_state().numpy().tobytes() if spec.temperature else b"")


def _prefilled(llava, executors, n_tiles, words, params):
    path, info, tiles, _, model = llava
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = prompt_ids(tok, " ".join(["Describe the picture"] + ["again"] * words), n_tiles, info)
    enc, pre, _ = executors
    mm = enc.encode(tiles[:n_tiles]).reshape(-1, info.hidden)
    g = params.make_generator()
    first, kv = pre.prefill_prompt(ids, mm, params, g)
    return ids, tiles[:n_tiles], first, kv, g.get_state().numpy().tobytes()


@pytest.mark.parametrize("sampling", [SamplingSpec(), SamplingSpec(temperature=0.9, top_k=50, top_p=0.9, seed=4)],
                         ids=["greedy", "seeded"])
def test_requests_joining_a_running_decode_batch_each_get_the_tokens_they_would_alone(llava, executors, sampling):
    from agents.techniques.phase_disaggregation.phases import DecodeBatch, sampling_params, to_bytes

    model = llava[4]
    answers = {}
    batch = DecodeBatch(executors[2], answer=lambda msg, reply: answers.__setitem__(msg.request, reply))
    requests = {0: (4, 0, 9), 1: (1, 5, 6), 2: (2, 2, 8)}  # tiles, extra words, tokens: contexts of other lengths
    msgs = {}
    for rid, (n_tiles, words, n) in requests.items():
        ids, tiles, first, kv, rng = _prefilled(llava, executors, n_tiles, words, sampling_params(sampling, n))
        msgs[rid] = (ids, tiles, DecodeTokens(request=rid, first_token=first, kv_shape=tuple(kv.shape),
                                               kv=to_bytes(kv), max_new_tokens=n, sampling=sampling, rng=rng))
    batch.add(msgs[0][2])
    batch.step()
    batch.step()
    batch.add(msgs[1][2])
    batch.add(msgs[2][2])
    batch.step()
    assert len(batch.running) == 3  # joined the running request, did not wait for it to finish
    while batch:
        batch.step()
    for rid, (ids, tiles, msg) in msgs.items():
        kw = dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.9) if sampling.temperature else dict(
            do_sample=False)
        torch.manual_seed(sampling.seed)
        ref = _generate(model, ids, tiles, msg.max_new_tokens, **kw)
        reply = answers[rid]
        assert [msg.first_token, *reply.tokens] == ref
        assert len(reply.step_ends) == len(reply.tokens) == msg.max_new_tokens - 1


def test_a_bad_request_in_a_decode_batch_is_answered_with_its_error_and_the_others_go_on(llava, executors):
    from agents.techniques.phase_disaggregation.phases import DecodeBatch, sampling_params, to_bytes

    answers = {}
    batch = DecodeBatch(executors[2], answer=lambda msg, reply: answers.__setitem__(msg.request, reply))
    _, _, first, kv, rng = _prefilled(llava, executors, 1, 0, sampling_params(SamplingSpec(), 4))
    batch.add(DecodeTokens(request=0, first_token=first, kv_shape=tuple(kv.shape), kv=to_bytes(kv), max_new_tokens=4,
                           rng=rng))
    bad = torch.zeros(1, 2, 1, 3, 1)
    batch.add(DecodeTokens(request=1, first_token=1, kv_shape=tuple(bad.shape), kv=to_bytes(bad), max_new_tokens=4))
    while batch:
        batch.step()
    assert isinstance(answers[1], PhaseRequestError) and "KV cache must be" in str(answers[1])
    assert len(answers[0].tokens) == 3


def test_a_devices_phases_name_its_stage_kind_and_a_set_no_layout_uses_is_refused():
    from agents.techniques.phase_disaggregation.kinds import kind_for

    assert kind_for(["decode"]) == "epd-decode"
    assert kind_for(["prefill", "encode"]) == "epd-encode-prefill"
    assert kind_for(["encode", "prefill", "decode"]) == "epd-aggregated"
    with pytest.raises(ValueError, match="no EPD stage serves the phases prefill, decode together"):
        kind_for(["decode", "prefill"])


@pytest.mark.parametrize("kind", ["epd-encode", "epd-prefill", "epd-decode", "epd-encode-prefill", "epd-aggregated"])
def test_a_phase_stage_plans_from_the_header_the_weights_it_holds_and_is_refused_before_loading(llava, kind):
    from agents.emulation import DeviceEmulation, ShardOverBudget
    from agents.techniques.phase_disaggregation.handlers import EXECUTORS

    llava_dir, seen = str(llava[0]), []

    def budget(weight_bytes, kv_bytes=0):
        seen.append(weight_bytes)

    executor = EXECUTORS[kind](llava_dir, 0, 1, dtype="float32", threads=None, budget=budget)
    assert seen == [executor.memory_bytes()]

    small = DeviceEmulation(memory_budget_bytes=executor.memory_bytes() - 1).shard_check("a", (0, 1))
    with pytest.raises(ShardOverBudget, match="memory budget"):
        EXECUTORS[kind](llava_dir, 0, 1, dtype="float32", threads=None, budget=small)
