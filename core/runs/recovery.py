"""How a run survives a lost device: where to resume, and the plan to resume on.

When an agent of a run is lost, the coordinator (``Coordinator.run(..., replan=)``) asks a
``Replanner`` for a plan over the survivors, loads it, and starts the run again from
``resume_point``: every unfinished micro-batch's prompt followed by the tokens it already
produced, so the new stages' prefill rebuilds the KV caches, and each micro-batch's sampler
continues at the step it stopped at (``StartRun.first_steps``; the draw of a step is keyed
by its position, ``agents.sampling.step_generator``). Greedy and seeded sampling therefore
give the undisturbed run's tokens. The decisions here are pure; the coordinator acts on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from agents.protocol import TokenEvent
from core.errors import ModelDoesNotFit, PlanInvalid, RunFailed
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem

OnFailure = Literal["replan", "stop"]
ON_FAILURE: tuple[str, ...] = ("replan", "stop")


class RecoveryImpossible(RunFailed):
    """A device was lost mid-run and no plan fits the survivors; ``missing_bytes`` says how
    much memory is missing (0 when memory is not the reason)."""

    def __init__(self, message: str, device: str | None = None, missing_bytes: int = 0):
        self.missing_bytes = missing_bytes
        super().__init__(message, device)


@dataclass(frozen=True)
class Resume:
    """What a resumed segment starts from (the fields of ``StartRun`` that differ)."""

    input_ids: tuple[tuple[int, ...], ...]
    """Every sequence's prompt followed by its fed tokens, left-padded to one length."""
    attention_mask: tuple[tuple[int, ...], ...]
    micro_batches: tuple[tuple[int, ...], ...]
    """The unfinished micro-batches' sequences (finished ones are left out)."""
    keys: tuple[int, ...]
    """Per resumed micro-batch, its index in the interrupted run (its sampler's key)."""
    first_steps: tuple[int, ...]
    """Per resumed micro-batch, the generation step its prefill produces."""
    generated: tuple[tuple[int, ...], ...]
    """Per sequence, the tokens already produced (up to and including EOS)."""

    @property
    def context_tokens(self) -> int:
        return len(self.input_ids[0]) if self.input_ids else 0


def resume_point(
    input_ids: tuple[tuple[int, ...], ...],
    attention_mask: tuple[tuple[int, ...], ...],
    groups: tuple[tuple[int, ...], ...],
    tokens: list[TokenEvent] | tuple[TokenEvent, ...],
    *,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int,
) -> Resume:
    """Where a run over ``groups`` resumes, given the tokens it produced (``TokenEvent``s in
    the interrupted run's micro-batch and step numbering). Only contiguous steps from 0 count
    (a step whose tokens never arrived is produced again)."""
    eos = set(eos_token_ids)
    by_step: dict[tuple[int, int], TokenEvent] = {(t.micro_batch, t.step): t for t in tokens}
    generated: list[list[int]] = [[] for _ in input_ids]
    fed: list[list[int]] = [[] for _ in input_ids]
    steps_done: list[int] = []
    for mb, seqs in enumerate(groups):
        finished = {s: False for s in seqs}
        step = 0
        while (mb, step) in by_step and not all(finished.values()):
            ev = by_step[(mb, step)]
            for seq, tok in zip(ev.sequence_ids, ev.token_ids):
                if seq not in finished:
                    continue
                if finished[seq]:
                    fed[seq].append(pad_token_id)
                    continue
                generated[seq].append(tok)
                fed[seq].append(tok)
                finished[seq] = tok in eos or len(generated[seq]) >= max_new_tokens
            step += 1
        steps_done.append(step if not all(finished.values()) else -1)
    resumed = [mb for mb, k in enumerate(steps_done) if k >= 0]
    width = max(len(input_ids[0]) + max((steps_done[mb] for mb in resumed), default=0), 1)
    ids, mask = [], []
    for seq, (row, m) in enumerate(zip(input_ids, attention_mask)):
        extra = fed[seq] if any(seq in groups[mb] for mb in resumed) else []
        pad = width - len(row) - len(extra)
        ids.append((pad_token_id,) * pad + tuple(row) + tuple(extra))
        mask.append((0,) * pad + tuple(m) + (1,) * len(extra))
    return Resume(
        input_ids=tuple(ids), attention_mask=tuple(mask),
        micro_batches=tuple(groups[mb] for mb in resumed), keys=tuple(resumed),
        first_steps=tuple(steps_done[mb] for mb in resumed), generated=tuple(tuple(g) for g in generated),
    )


class Replanner(Protocol):
    """A plan over the survivors of ``plan`` without ``failed``, on ``usable`` devices only
    (those with a live agent). Raises ``RecoveryImpossible`` when none fits."""

    def __call__(self, plan: ShardPlan, failed: str, usable: tuple[str, ...]) -> ShardPlan: ...


class ExactReplanner:
    """Re-plans with the exact solver, warm-started from the interrupted plan
    (``core.planning.solvers.replan_after_failure``); every device lost so far stays excluded. The
    new plan keeps the run's weight precision (the solver plans the memory of fp weights, so it may
    find no plan where one at int8/int4 would fit); a plan mixing precisions is not re-planned."""

    def __init__(self, problem: PlanningProblem, time_limit_s: float = 5.0) -> None:
        self.problem = problem
        self.time_limit_s = time_limit_s

    def planning_problem(self, plan: ShardPlan) -> PlanningProblem:
        """The problem the survivors are planned with: the run's own; a technique whose stages need other
        memory than layer sharding's (expert offloading: resident weights and a buffer, not every expert)
        gives its own (``core.techniques.replanner_for``)."""
        return self.problem

    def __call__(self, plan: ShardPlan, failed: str, usable: tuple[str, ...]) -> ShardPlan:
        import msgspec

        replanned = self.solve(plan, failed, usable)
        self.problem = msgspec.structs.replace(self.problem,
                                               excluded_devices=(*self.problem.excluded_devices, failed))
        return replanned

    def solve(self, plan: ShardPlan, failed: str, usable: tuple[str, ...]) -> ShardPlan:
        """The re-plan alone (``__call__`` also keeps ``failed`` excluded from later ones)."""
        import msgspec

        from core.planning.placement import gpu_placement, on_the_same_gpus, placed_problem
        from core.planning.plan import with_weights
        from core.planning.solvers import replan_after_failure

        precisions = {s.weights for s in plan.stages}
        if len(precisions) > 1:  # a re-split would put blocks at another precision: the tokens would change
            raise RecoveryImpossible(f"{failed} was lost and the plan mixes weight precisions "
                                     f"({', '.join(sorted(precisions))}), which the solvers do not re-plan", failed)
        unusable = tuple(d for d in self.problem.profile.cluster.device_ids()
                         if d not in usable and d != failed and d not in self.problem.excluded_devices)
        problem = msgspec.structs.replace(self.planning_problem(plan),
                                          excluded_devices=(*self.problem.excluded_devices, *unusable))
        on_gpu = {d: g for d, g in gpu_placement(plan).items() if d != failed}  # again on its GPU, at its times
        try:
            result = replan_after_failure(placed_problem(problem, on_gpu), plan, failed, time_limit_s=self.time_limit_s)
        except ModelDoesNotFit as err:
            raise RecoveryImpossible(f"{failed} was lost and no plan fits the survivors "
                                     f"({', '.join(d for d in usable if d != failed) or 'none'}): {err}",
                                     failed, err.missing_bytes) from None
        except PlanInvalid as err:
            raise RecoveryImpossible(f"{failed} was lost and the run cannot be re-planned: "
                                     + "; ".join(err.violations), failed) from None
        # every block stays at the run's precision, every surviving GPU stage on its GPU
        return on_the_same_gpus(plan, with_weights(result.plan, precisions.pop()))


def keep_stage_settings(old: ShardPlan, new: ShardPlan) -> ShardPlan:
    """``new`` (re-planned over the survivors by a solver that places units only) with the interrupted
    plan's stage kinds and settings (``Stage.kind``/``Stage.options``), so a resumed run stays the same
    technique (an expert-offload stage stays one, with its buffer, not a stage with every expert
    resident). A new stage takes the settings of the one non-``layers`` kind whose decoder blocks (units
    1 .. N-2) it holds; one holding none of them (the embedding or the head alone) is a ``layers`` stage.
    Two different kinds or settings are not re-split (``RecoveryImpossible``): which stage gets which?
    A ``new`` whose re-planner set kinds itself (expert offloading's smaller buffer that fits) is kept as set."""
    import msgspec

    if any(s.kind != "layers" or s.options is not None for s in new.stages):
        return new

    def key(s) -> tuple[str, bytes]:
        return s.kind, msgspec.json.encode(s.options, order="sorted")

    special = {key(s): s for s in old.stages if s.kind != "layers" or s.options is not None}
    if len(special) > 1:
        raise RecoveryImpossible("the plan's stages are of different kinds or settings ("
                                 + ", ".join(sorted(f"{s.device}: {s.kind}" for s in special.values()))
                                 + "), which a re-plan cannot give back to the survivors' stages")
    if not special:
        return new
    setting = next(iter(special.values()))
    blocks = {u for s in old.stages if key(s) == key(setting) for u in range(max(s.start, 1), min(s.end, old.num_units - 1))}
    stages = tuple(msgspec.structs.replace(s, kind=setting.kind, options=setting.options)
                   if blocks & set(range(s.start, s.end)) else msgspec.structs.replace(s, kind="layers", options=None)
                   for s in new.stages)
    return msgspec.structs.replace(new, stages=stages)


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery of a run, on the run's clock (seconds from its start)."""

    failed: str
    step: int
    """The furthest generation step any micro-batch had produced when the loss was noticed."""
    detected_s: float
    replanned_s: float
    loaded_s: float
    resumed_s: float
    """When the resumed segment was started (its first token comes after its prefill)."""
    old_stages: tuple[str, ...]
    new_stages: tuple[str, ...]
    plan: ShardPlan | None = None
    """The re-planned plan the resumed segment ran on."""
    keys: tuple[int, ...] = ()
    first_steps: tuple[int, ...] = ()
    """The resumed segment's micro-batches (``Resume.keys``) and the step each resumed at."""
    resumed_width: int = 0
    """Positions of the resumed segment's prefill (prompts and the tokens already produced)."""
    also_lost: tuple[str, ...] = ()
    """The other agents found lost with ``failed`` (not answering), left out of the re-plan too."""
    wire_at_resume: object = None
    """The new stages' wire counters as the segment started (``core.runs.wire.WireTraffic``; None
    unread): what they sent after the re-plan is the difference to the run's end."""
