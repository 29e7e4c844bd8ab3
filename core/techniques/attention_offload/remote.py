"""A memory agent as an attention side: the dense side's ``HeadRouter`` calls it like an
in-process ``AttentionStore``, and it asks a real agent over the agent link (``AttendHeads``:
raw float32 frames, never pickled). ``wire_bytes`` counts the encoded request and reply frames."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agents.protocol import ErrorReply, Ok, encode_control
from agents.techniques.attention_offload.messages import AttendHeads, HeadsAttended
from core.errors import RunFailed


class RemoteAttentionSide:
    """Key/value heads ``kv_heads`` of ``model_dir``, held by agent ``device``."""

    def __init__(self, link, device: str, model_dir: str, kv_heads: range, timeout_s: float = 60.0):
        self.link, self.device, self.model_dir, self.kv_heads = link, device, str(model_dir), kv_heads
        self.timeout_s = timeout_s
        self.wire_bytes = 0

    def attend(self, group: int, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        q, k, v = (t.detach().to(torch.float32).contiguous() for t in (query, key, value))
        msg = AttendHeads(model_dir=self.model_dir, kv_start=self.kv_heads.start, kv_stop=self.kv_heads.stop,
                          group=group, layer=layer, q_shape=tuple(q.shape), kv_shape=tuple(k.shape),
                          query=q.numpy().tobytes(), key=k.numpy().tobytes(), value=v.numpy().tobytes(),
                          mask_shape=tuple(mask.shape) if mask is not None else (),
                          mask=mask.to(torch.uint8).contiguous().numpy().tobytes() if mask is not None else b"",
                          scaling=float(scaling))
        reply = self.link.request(self.device, msg, timeout_s=self.timeout_s)
        if not isinstance(reply, HeadsAttended):
            detail = reply.message if isinstance(reply, ErrorReply) else type(reply).__name__
            raise RunFailed(f"memory agent {self.device!r} could not attend heads "
                            f"{self.kv_heads.start}..{self.kv_heads.stop - 1}: {detail}")
        self.wire_bytes += len(encode_control(msg)) + len(encode_control(reply))
        return torch.frombuffer(bytearray(reply.data), dtype=torch.float32).reshape(reply.shape)

    def drop(self, group: int, layers: Sequence[int] | None = None) -> None:
        msg = AttendHeads(model_dir=self.model_dir, kv_start=self.kv_heads.start, kv_stop=self.kv_heads.stop,
                          group=group, drop=True, drop_layers=tuple(layers or ()))
        reply = self.link.request(self.device, msg, timeout_s=self.timeout_s)
        if not isinstance(reply, Ok):
            raise RunFailed(f"memory agent {self.device!r} did not drop group {group}: {reply}")
