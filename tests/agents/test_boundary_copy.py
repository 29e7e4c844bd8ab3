"""A GPU stage's boundary activations go through pinned host buffers reused per shape, copied on a side
stream and sent once copied while the stage computes on. The CI machine has no GPU: the backend seam
(``agents.accelerators.CudaBackend``) here computes on this CPU under a GPU's name and copies on a
thread of its own that takes ``delay_s`` per copy (or waits for its ``gate``), like a copy engine beside the
computing stream (real
torch modules, real zmq sockets, real agents). What it cannot show: CUDA's own stream ordering and the
PCIe overlap itself (bench/gpu_check.sh's ``overlap`` step does, on a GPU)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
import zmq

from agents.accelerators import CudaBackend
from agents.boundary_copy import BoundaryCopies, OrderedSends, PendingHost


GATE_TIMEOUT_S = 10.0
"""How long a gated copy waits to be let through: only a test whose caller wrongly waited for it waits this long."""


class _Copying:
    """A copy in flight on the seam's copy thread: what a CUDA event answers."""

    def __init__(self, future: concurrent.futures.Future, waits: list[str]) -> None:
        self.future, self.waits = future, waits

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.waits.append(threading.current_thread().name)
        self.future.result()


class CpuGpuWithCopyEngine(CudaBackend):
    """A GPU as a stage sees one, computing on this CPU; its copies to the host run on another thread."""

    def __init__(self, delay_s: float = 0.0, memory_bytes: int = 1 << 30, gate: threading.Event | None = None) -> None:
        self.delay_s, self.memory_bytes, self.copies_to_host, self.copies_to_device = delay_s, memory_bytes, 0, 0
        self.gate = gate
        """Copies to the host finish only once it is set: "still copying" is then a fact, not a race
        between a sleep and a loaded host's scheduler."""
        self.waited_on: list[str] = []
        """The thread each wait for a copy to the host ran on."""

    def devices(self):
        return (("cuda:0", "CPU under a GPU's name", self.memory_bytes),)

    def place(self, name):
        return torch.device("cpu")

    def sync(self, name):
        pass

    def memory(self, name):
        return self.memory_bytes, self.memory_bytes

    def pinned(self, shape, dtype):
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype)  # a CPU build of torch cannot page-lock

    def copy_stream(self, name):
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="seam-copy-engine")

    def copy_to_host(self, src, dst, stream):
        self.copies_to_host += 1

        def copy():
            if self.gate is not None:
                self.gate.wait(GATE_TIMEOUT_S)
            time.sleep(self.delay_s)
            dst.copy_(src)

        return _Copying(stream.submit(copy), self.waited_on)

    def copy_to_device(self, src, device):
        self.copies_to_device += 1
        done = concurrent.futures.Future()
        done.set_result(None)
        return src.clone(), _Copying(done, [])


def test_an_output_copies_beside_the_caller_into_a_pinned_buffer_reused_per_shape():
    gate = threading.Event()
    seam = CpuGpuWithCopyEngine(gate=gate)
    copies = BoundaryCopies("cuda:0", seam)
    a, b = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with copies.deferred():
        first, second = copies.to_host(a), copies.to_host(b)
    # neither copy waited for: both returned while the copy engine still holds them (had to_host
    # waited, it would have returned only after GATE_TIMEOUT_S, its copy done)
    assert isinstance(first, PendingHost) and not first.ready() and not second.ready()
    gate.set()
    got_a, got_b = first.wait(), second.wait()
    assert torch.equal(got_a, a) and torch.equal(got_b, b)  # two in flight at once: two buffers, neither overwritten
    assert copies.buffers_made == 2
    again = copies.to_host(torch.ones(1, 3, 8))  # outside deferred(): waited, a host tensor
    assert isinstance(again, torch.Tensor) and torch.equal(again, torch.ones(1, 3, 8))
    assert copies.buffers_made == 2 and torch.equal(got_a, a)  # the buffer was reused; what was sent kept its values
    copies.to_host(torch.ones(2, 3, 8))
    assert copies.buffers_made == 3  # a new shape, a buffer of its own


def test_a_received_tensor_goes_onto_the_gpu_through_one_pinned_buffer_per_shape():
    seam = CpuGpuWithCopyEngine()
    copies = BoundaryCopies("cuda:0", seam)
    x, y = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    on_gpu_x, on_gpu_y = copies.to_device(x), copies.to_device(y)
    assert torch.equal(on_gpu_x, x) and torch.equal(on_gpu_y, y) and seam.copies_to_device == 2
    assert len(copies._inbound) == 1


def test_sends_leave_in_order_each_once_its_copy_is_done_while_the_caller_moves_on():
    from agents.transport import LinkSender

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://boundary-copy-order")
    push.connect("inproc://boundary-copy-order")
    gate = threading.Event()
    copies = BoundaryCopies("cuda:0", CpuGpuWithCopyEngine(gate=gate))
    sends = OrderedSends(LinkSender(push))
    try:
        with copies.deferred():
            pending = copies.to_host(torch.full((4,), 7.0))
        sends.after(pending, lambda host: sends.send([host.numpy().tobytes()], 16))
        sends.send([b"sent after it"], 13)  # asked for later: leaves later, though it was ready at once
        # the caller did not wait for the copy: it is back while the copy is held, and nothing left
        assert not pending.ready() and not pull.poll(50)
        gate.set()
        assert pull.poll(30_000)
        first, second = pull.recv_multipart(), pull.recv_multipart()
        assert torch.equal(torch.frombuffer(bytearray(first[0]), dtype=torch.float32), torch.full((4,), 7.0))
        assert second == [b"sent after it"]
        assert sends.overlapped == 1
    finally:
        sends.close(drain=True)
        push.close(0)
        pull.close(0)


def test_an_aborted_runs_queued_sends_are_dropped_and_the_thread_ends():
    class Refusing:
        shaped = False

        def send(self, *args):
            raise AssertionError("an aborted run sent")

    copies = BoundaryCopies("cuda:0", CpuGpuWithCopyEngine(delay_s=0.2))
    sends = OrderedSends(Refusing())
    with copies.deferred():
        pending = copies.to_host(torch.ones(3))
    sends.after(pending, lambda host: sends.send([b"x"], 1))
    sends.send([b"y"], 1)
    sends.close(drain=False)
    assert not sends._thread.is_alive()


def test_an_int4_stage_on_a_gpu_is_refused_at_load(tiny_model):
    from agents.checkpoint_reader import CheckpointError
    from agents.shard import StageExecutor

    with pytest.raises(CheckpointError, match="int4 weights are packed for the CPU"):
        StageExecutor(tiny_model, 0, 6, torch_device="cuda:0", weights="int4", accelerators=CpuGpuWithCopyEngine())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    return str(make_model(recipe, tmp_path_factory.mktemp("boundary-copy") / "tiny-llama"))


def test_a_gpu_first_stage_over_two_agents_gives_generates_tokens_with_its_copies_overlapped(tiny_model):
    """Stage 0 on the seam's GPU, stage 1 on the CPU, two micro-batches (the next one computes while the
    last one's output is copying): greedy tokens equal transformers' generate, and the stage's outputs
    went through a handful of reused pinned buffers, not one per step."""
    import transformers

    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import AgentEndpoint, Coordinator, RunRequest
    from core.runs.generation import load_tokenizer

    prompts, new = ["the cat sat", "a much longer prompt about the river", "hello", "one more"], 8
    enc = load_tokenizer(tiny_model)(prompts, return_tensors="pt", padding=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    out = model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    expected = out[:, enc["input_ids"].shape[1]:].tolist()

    keys = CurveKeys.generate()
    seam = CpuGpuWithCopyEngine(delay_s=0.003)
    agents = [Agent("gpu-box", keys.public, accelerators=seam).start(), Agent("cpu-box", keys.public).start()]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys,
                         heartbeat_timeout_s=60.0) as co:
            plan = plan_from_boundaries("tiny-llama", 6, ["gpu-box", "cpu-box"], [3])
            co.load(plan, tiny_model, timeout_s=120, torch_devices={"gpu-box": "cuda:0"})
            request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                                 attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                                 max_new_tokens=new, mode="no-bubbles", micro_batches=2, eos_token_ids=(),
                                 pad_token_id=0)
            got = [list(t) for t in co.run(plan, request).tokens]
            boundary = agents[0]._loaded.executor.boundary
    finally:
        for a in agents:
            a.close()
    assert got == expected
    assert seam.copies_to_host == 2 * new  # every step of both micro-batches went through the copies
    assert set(seam.waited_on) == {"edgeshard-copy-send"}  # waited for by the sending thread, not the computing one
    assert boundary is not None and boundary.buffers_made <= 4  # prefill and decode shapes, two in flight at most
    assert threading.active_count() < 50
