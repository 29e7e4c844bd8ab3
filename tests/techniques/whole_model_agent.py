"""The test-only technique's agent side, a room outside ``agents/``: an agent loads it with
``--technique-module tests.techniques.whole_model_agent`` (or ``EDGESHARD_AGENT_TECHNIQUES``).

It registers everything through ``agents.registry`` alone — no shared agent, core or gui module
names it: its stage kind's executor (the whole HF model with its own KV cache, not agents.shard),
a control message of its own (``TopLogits``: the loaded model's top-k next-token logits of a
prompt, pushed to a data socket the request names) and a data-frame kind of its own
(``whole-model-top``, whose options say which request and prompt length the tensors answer).
It imports only ``agents`` (an agent ships alone)."""

from __future__ import annotations

import torch

from agents.envelope import Message, Options, PeerSpec, peer_problem
from agents.protocol import AgentState, DataHeader, Ok, options_slot
from agents.registry import AgentTechnique, DataKind, Handler

STAGE_KIND = "whole-model"
TOP_KIND = "whole-model-top"


class WholeModelExecutor:
    """Its stage: the whole HF model with its own KV cache per micro-batch group."""

    is_first = True
    is_last = True

    def __init__(self, model_dir: str, start: int, end: int, *, dtype: str, threads: int | None, progress=None):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.groups: dict[int, tuple[object, torch.Tensor]] = {}
        if progress:
            progress(1.0)

    @torch.inference_mode()
    def _forward(self, group: int, ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True)
        self.groups[group] = (out.past_key_values, mask)
        return out.logits[:, -1, :].float()

    def prefill(self, group: int, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        return self._forward(group, x, attention_mask.to(torch.long), DynamicCache(config=self.model.config))

    def decode(self, group: int, x: torch.Tensor) -> torch.Tensor:
        cache, mask = self.groups[group]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        return self._forward(group, x, mask, cache)

    def drop(self, group: int) -> None:
        self.groups.pop(group, None)

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def top_logits(self, input_ids: tuple[int, ...], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest next-token logits after ``input_ids`` and their token ids (no cache kept)."""
        logits = self.model(input_ids=torch.tensor([input_ids], dtype=torch.int64)).logits[0, -1].float()
        top = torch.topk(logits, k)
        return top.values.contiguous(), top.indices.to(torch.int64).contiguous()


class TopLogits(Message, frozen=True, tag="whole_model_top_logits"):
    """Push the loaded whole model's top-``k`` next-token logits after ``input_ids`` to ``send_to``'s
    data socket as one ``whole-model-top`` frame (values float32 [k], token ids int64 [k]); answered
    ``Ok`` once sent."""

    request: int
    input_ids: tuple[int, ...]
    k: int
    send_to: PeerSpec

    def problem(self) -> str:
        if not 0 <= self.request < 1 << 31 or not 1 <= self.k <= 64:
            return "request must be in [0, 2**31) and k in [1, 64]"
        if not 1 <= len(self.input_ids) <= 4096 or not all(0 <= i < 1 << 31 for i in self.input_ids):
            return "input_ids must be 1..4096 token ids in [0, 2**31)"
        return peer_problem(self.send_to)


class TopSpec(Options, frozen=True, tag="whole-model-top"):
    """What a ``whole-model-top`` frame answers: its request and the prompt's length."""

    request: int
    prompt_tokens: int

    def problem(self) -> str:
        return "" if 0 <= self.request < 1 << 31 and 1 <= self.prompt_tokens <= 4096 else \
            "request must be in [0, 2**31) and prompt_tokens in [1, 4096]"


def _admit(agent, msg: TopLogits):
    loaded = agent.loaded_stage
    if agent.state is not AgentState.READY or loaded is None or loaded.msg.kind != STAGE_KIND:
        return "bad_state", f"load a {STAGE_KIND} stage before asking for its top logits"
    return None


def _send_top_logits(agent, msg: TopLogits, stop):
    """On the worker: compute, then push the frame to the asker's data socket (Curve, raw tensors)."""
    from agents.transport import PeerSenders, data_message, tensor_frame

    executor = getattr(agent.loaded_stage.executor, "_executor", agent.loaded_stage.executor)  # emulation wrapper
    values, ids = executor.top_logits(msg.input_ids, msg.k)
    specs, bufs = zip(tensor_frame(values), tensor_frame(ids))
    header = DataHeader(run_id="whole-model", kind=TOP_KIND, phase="prefill", step=0, micro_batch=0,
                        sender=agent.device, tensors=specs, t_sent=agent.clock(),
                        options=options_slot(TopSpec(request=msg.request, prompt_tokens=len(msg.input_ids))))
    state = agent.room(AGENT_TECHNIQUE.name)  # kept while the stage is: a closed socket drops what it still holds
    if "senders" not in state:
        state["senders"] = PeerSenders(agent.context, agent.keys, 1000, clock=agent.clock)
    state["senders"].to(msg.send_to.device, msg.send_to, None).send(data_message(header, list(bufs)),
                                                                    sum(s.nbytes() for s in specs))
    return Ok(req=msg.req, detail=f"top {msg.k} logits sent to {msg.send_to.device}")


def _close_senders(agent) -> None:
    senders = agent.room(AGENT_TECHNIQUE.name).pop("senders", None)
    if senders is not None:
        senders.close()


AGENT_TECHNIQUE = AgentTechnique(
    name="whole-model",
    messages=(TopLogits,),
    options=(TopSpec,),
    data_kinds=(DataKind(TOP_KIND, TopSpec),),
    handlers=(Handler(TopLogits, serve=_send_top_logits, admit=_admit, exclusive=True, wanted="send top logits"),),
    executors={STAGE_KIND: WholeModelExecutor},
    on_unload=_close_senders,
)
