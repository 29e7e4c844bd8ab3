"""Attention offloading's memory model, term by term, against the tensors a memory side really holds."""

import torch

from agents.techniques.attention_offload.heads import AttentionStore, HeadShape
from core.techniques.attention_offload import cost, scenarios
from core.techniques.attention_offload.problem import OffloadModel, OffloadPlan

import msgspec

MODEL = OffloadModel(name="t", layers=2, hidden=128, q_heads=8, kv_heads=2, head_dim=16, intermediate=256,
                     vocab=64, bytes_per_element=4)


def test_prefill_attend_bytes_counts_the_attends_own_tensors():
    batch, prompt = 3, 10
    store = AttentionStore(HeadShape(layers=2, q_heads=8, kv_heads=2, head_dim=16), range(0, 1))
    q, k, v = torch.randn(batch, 4, prompt, 16), torch.randn(batch, 1, prompt, 16), torch.randn(batch, 1, prompt, 16)
    mask = torch.ones(batch, 1, prompt, prompt, dtype=torch.bool).tril()
    out = store.attend(0, 0, q, k, v, mask, 0.25)
    received = q.nbytes + k.nbytes + v.nbytes + mask.to(torch.uint8).nbytes  # the frames, as sent
    repeated = 2 * k.nbytes * 4  # key and value repeated to the four query heads of the kv head
    assert MODEL.prefill_attend_bytes(batch, prompt, 1) == received + mask.nbytes + repeated + out.nbytes


def test_memory_device_need_is_kv_share_plus_one_prefill_attend():
    base = scenarios.paper()
    problem = msgspec.structs.replace(base, model=MODEL, workload=msgspec.structs.replace(
        base.workload, prompt_tokens=20, generated_tokens=4))
    plan = OffloadPlan(compute=(base.devices[0].id,), memory=tuple(d.id for d in base.devices[2:4]), batch=4,
                       in_flight=2)
    kv_share = 2 * 4 * 24 * (2 * MODEL.layers * 1 * MODEL.head_dim * 4)  # in flight × batch × context × K,V of one head
    assert cost.evaluate(problem, plan).memory_bytes == kv_share + MODEL.prefill_attend_bytes(4, 20, 1)
