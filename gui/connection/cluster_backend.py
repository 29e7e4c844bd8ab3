"""The Run screen's backend over live agents: ``core.runs.generation.generate`` on the studio's plan
(or, for a plan of a technique with its own run driver, ``Technique.run_generation``).

Implements ``gui.screens.run.RunBackend`` with a ``core.runs.coordinator.Coordinator``. Text in,
text out is ``core.runs.generation``'s job (the same tokenizer handling, stop ids and streamed
text pieces as ``edgeshard run``); this class only checks what the operator can fix first
and loads the plan when the agents do not hold it (it changed, or a failure unloaded it).
"""

from __future__ import annotations

import dataclasses

import os
from typing import Any

from core.runs.coordinator import Coordinator
from core.errors import EdgeShardError, ShardOverBudget
from core.runs.generation import GenerationSettings, generate
from core.planning.plan import offline_problems
from core.reporting import Reporter
from core.techniques import generation_for, replanner_for


def plan_within_refusal(problem, plan, device: str, refusal: Exception):
    """(problem, the exact solver's plan for it) once ``device`` is known to hold less than
    ``plan`` gave it (its agent refused that shard at load: the profile overstated its budget),
    the problem's budget for it lowered below that; the refusal itself when no plan fits."""
    import msgspec

    from core.errors import ModelDoesNotFit, PlanInvalid
    from core.planning.cost import evaluate
    from core.planning.solvers import solve_min_latency

    stage = next((j for j, s in enumerate(plan.stages) if s.device == device), None)
    if stage is None:
        raise refusal
    needed = evaluate(problem, plan).memory[stage].total_bytes
    cluster = problem.profile.cluster
    devices = tuple(msgspec.structs.replace(d, memory_bytes=min(d.memory_bytes, needed - 1)) if d.id == device else d
                    for d in cluster.devices)
    smaller = msgspec.structs.replace(problem, profile=msgspec.structs.replace(
        problem.profile, cluster=msgspec.structs.replace(cluster, devices=devices)))
    try:
        return smaller, solve_min_latency(smaller).plan
    except (ModelDoesNotFit, PlanInvalid):
        raise refusal from None


class ClusterRunBackend:
    def __init__(self, coordinator: Coordinator, state) -> None:
        self.coordinator = coordinator
        self.state = state
        """The StudioState whose plan is run (read on the worker: plans are immutable values)."""
        self._loaded_with_sent_weights = False

    def lanes(self) -> list[str]:
        plan = self.state.plan
        if plan is None or generation_for(plan) is not None:  # a technique that also calls agents outside the plan
            first = plan.devices() if plan is not None else []  # its own stages' lanes on top
            return [*first, *(d for d in self.coordinator.endpoints if d not in first)]
        return list(plan.devices())

    def lane_notes(self, settings) -> dict[str, str]:
        """Each agent's role in a run of an attention-offload plan (compute replica / attention)."""
        plan = self.state.plan
        if plan is None or generation_for(plan) is None or not settings.technique_options:
            return {}
        from core.errors import RunFailed
        from core.techniques.attention_offload.run import OffloadRunOptions, lane_roles

        try:
            options = OffloadRunOptions.of(settings.technique_options)
        except RunFailed:
            return {}  # the run itself says what is wrong
        return lane_roles(plan.devices()[0], self.lanes(), options)

    def run(self, settings, sink, reporter: Reporter) -> Any:
        """Run ``settings`` and say what happened, with the run's wire figures (``core.runs.wire``: its
        agents' socket counts, beside layer sharding's prediction; measured only for a technique's own driver)."""
        from core.runs.wire import WireMeter, layer_sharding_wire, wire_figures

        lanes = self.lanes()
        with WireMeter(self.coordinator, lanes) as meter:
            said, ran = self._run(settings, sink, reporter)
        if ran is None:  # a technique's own driver, a speculative run: what the sockets sent, no prediction here
            said["wire"] = wire_figures(meter.traffic, lanes, None)
        else:
            out, started, model_dir, dtype = ran
            said["wire"] = layer_sharding_wire(model_dir, dtype, settings.prompts, out.result, meter, started)
        return said

    def _run(self, settings, sink, reporter: Reporter) -> tuple[dict, Any]:
        """What ``run`` says, and for a layer-sharded run (out, the plan it started on, model dir, dtype)."""
        plan = self.state.plan
        problem = self.state.problem
        if plan is None:
            raise EdgeShardError("no plan to run: make one on the Plan screen (Auto-solve) first")
        if problem is not None and plan.model != problem.profile.model.name:
            # the studio's problem is of another model (the demo's Llama under an expert-offload plan of its
            # MoE): its unit count and budgets neither check nor re-plan this plan
            problem = None
        technique_run = generation_for(plan)
        if problem is not None and technique_run is None:  # a technique's own driver checks its plan (an
            # attention-offload dense stage embeds the prompt on its compute agent, not on layer sharding's source)
            from core.planning.cost import structural_violations

            bad = structural_violations(problem, plan)
            if bad:
                raise EdgeShardError("the plan cannot run: " + "; ".join(bad))
        down = offline_problems(plan, getattr(self.state, "offline_devices", ()))
        if down:
            raise EdgeShardError("the plan cannot run: " + "; ".join(down))
        model_dir = settings.model_dir or getattr(self.state, "model_path", "")
        if not model_dir:
            raise EdgeShardError("choose the model checkpoint directory first")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise EdgeShardError(f"{model_dir} is not a checkpoint directory (no config.json): choose another")
        model_dir = os.path.abspath(model_dir)  # agents do not share the studio's working directory
        generation = GenerationSettings(
            max_new_tokens=settings.max_new_tokens,
            mode=settings.mode,
            micro_batches=settings.micro_batches,
            send_weights=settings.send_weights,
            repetition_penalty=settings.repetition_penalty,
            no_repeat_ngram_size=settings.no_repeat_ngram_size,
            frequency_penalty=getattr(settings, "frequency_penalty", 0.0),
            presence_penalty=getattr(settings, "presence_penalty", 0.0),
            ignore_eos=getattr(settings, "presenter_pace", False),
        )
        if technique_run is not None:  # its own run driver (Technique.run_generation); it loads each run
            out = technique_run(self.coordinator, plan, model_dir, list(settings.prompts), generation, sink=sink,
                                reporter=reporter, options=dict(getattr(settings, "technique_options", {}) or {}))
            return {"run_id": out.result.run_id, "wall_s": out.result.wall_s, "texts": list(out.texts)}, None
        if getattr(settings, "draft_dir", ""):  # speculative decoding: the CLI's own driver (edgeshard run --draft)
            said = self._run_speculative(plan, problem, model_dir, settings, generation, sink, reporter)
            if said is not None:
                return said, None
        # switching "Send stage weights" on or off reloads: the stages must come from where it says
        same_source = settings.send_weights == self._loaded_with_sent_weights
        load = not (self.coordinator.is_loaded(plan, model_dir) and same_source)
        replan = None
        if getattr(settings, "on_failure", "replan") == "replan" and problem is not None:
            replan = replanner_for(plan, problem, model_dir)  # no problem (a plan opened alone): a lost device stops the run
        refused = ""
        attempts = problem.profile.model.num_units * 2 if replan is not None else 1  # each lowers a budget
        for attempt in range(attempts):
            try:
                out = generate(self.coordinator, plan, model_dir, list(settings.prompts), generation, sink=sink,
                               reporter=reporter, load=load, replan=replan)
                break
            except ShardOverBudget as err:  # "Re-plan and resume": a device holds less than the profile said
                if replan is None or reporter.cancel_requested() or err.device is None or attempt == attempts - 1:
                    raise
                problem, plan = plan_within_refusal(problem, plan, err.device, err)
                refused = (f"{err.device} refused its shard over its memory budget: re-planned onto "
                           + ", ".join(f"{s.device}[{s.start},{s.end})" for s in plan.stages))
                reporter.status(refused)
                load, replan = True, replanner_for(plan, problem, model_dir)
        self._loaded_with_sent_weights = settings.send_weights
        recoveries = [f"{r.failed} lost at step {r.step}: re-planned onto {', '.join(r.new_stages)}"
                      for r in out.result.recoveries]
        return {"run_id": out.result.run_id, "wall_s": out.result.wall_s, "texts": list(out.texts),
                "recoveries": [refused, *recoveries] if refused else recoveries,
                "recovered_plan": out.result.plan if (out.result.recoveries or refused) else None}, \
            (out, plan, model_dir, generation.dtype)

    def _run_speculative(self, plan, problem, model_dir, settings, generation, sink, reporter) -> dict | None:
        """``core.runs.speculative.generate_speculative`` at the checked k (None: auto chose plain decoding)."""
        from core.runs.speculative import auto_settings, check_draft, generate_speculative

        # the Run screen checked the draft and the settings in its own words at Start (gui.techniques.speculative)
        k = settings.speculate_k
        speculative = (check_draft(model_dir, settings.draft_dir, k) if k is not None
                       else auto_settings(problem, plan, model_dir, settings.draft_dir))
        if speculative is None:
            reporter.status("Speculate k auto: plain decoding is predicted faster for this plan; running it plainly")
            return None
        if getattr(settings, "speculate_seed", 0):  # speculative sampling, seeded: the model's distribution
            generation = dataclasses.replace(generation, temperature=1.0, seed=settings.speculate_seed)
        reporter.status(f"Speculating {speculative.k} token(s) a trip with {os.path.basename(speculative.draft_dir)}")
        out = generate_speculative(self.coordinator, plan, model_dir, settings.prompts[0], generation, speculative,
                                   sink=sink, reporter=reporter)
        self._loaded_with_sent_weights = settings.send_weights
        return {"run_id": out.result.run_id, "wall_s": out.result.wall_s, "texts": list(out.texts),
                "speculate_k": speculative.k}

    def stop(self) -> None:
        self.coordinator.stop()
