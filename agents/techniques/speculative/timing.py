"""The draft's own cost where it runs (``TimeDraft``): the cost model priced a draft token by a proxy
from the target's profiled units, which came out about half of what the runs measure (the draft runs
as a whole transformers model per token), so ``--speculate auto`` and Compare over-predicted by
13-40 %. Timed as a run's source drafts (``session.Draft``: the same model cache, a context that
grows by what a trip commits, the first call re-feeding the tokens the draft has not seen), slowed
to the device's emulated speed as a stage's compute is."""

from __future__ import annotations

import statistics
import time

import torch

from agents.emulation import compute_began, end_emulated
from agents.techniques.speculative.messages import DraftTimed, TimeDraft


def time_draft(agent, msg: TimeDraft, stop) -> DraftTimed:
    from agents.model_code import MODEL_CODE_IMPORTED
    from agents.techniques.speculative.session import Draft, draft_model

    MODEL_CODE_IMPORTED.wait()
    threads = torch.get_num_threads()
    if msg.threads > 0:
        torch.set_num_threads(msg.threads)
    try:
        model = draft_model(agent, msg.draft_dir)
        vocab = int(model.config.vocab_size)
        ids = torch.randint(vocab, (msg.context + msg.trips * (msg.k + 1) + 2,), generator=torch.Generator().manual_seed(0))
        draft, context, per_trip = Draft(model), ids[:msg.context].tolist(), []
        for trip in range(msg.trips + 2):  # the first two warm the draft's calls up: not counted
            began, t0 = compute_began(), time.perf_counter()
            proposals, _ = draft.propose(context, msg.k)
            end_emulated(agent.emulation.compute_slowdown, began)
            if trip >= 2:
                per_trip.append((time.perf_counter() - t0) / msg.k)
            # a trip commits about half the proposals and the target's token: the next call re-feeds two
            context = context + proposals[: msg.k // 2] + [int(ids[msg.context + trip])]
    finally:
        torch.set_num_threads(threads)
    return DraftTimed(req=msg.req, token_s=statistics.median(per_trip), per_trip_s=tuple(per_trip))
