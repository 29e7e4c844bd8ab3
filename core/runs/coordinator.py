"""Loads a plan on its agents and runs generations over the agent link.

The connections themselves (sockets, the IO thread, requests, heartbeats, lost agents,
clock probes) are ``core.devices.agent_link.AgentLink``; this module adds what a run is:
loading every stage, starting them (downstream first), collecting the events and tokens
the agents stream to the run's ``RunSink`` (mapped onto the coordinator's clock), and
ending the run on ``RunFinished``, ``RunError``, an agent lost, or the operator's stop.

A run in progress ends with ``RunFailed`` naming the device when one of its agents is
lost, and every other agent is told to stop and unload (back to idle; the next run loads
the plan again). Nothing here touches Qt: sinks are plain callables that may run on the
link's IO thread.

The run's values, sinks and live stream are ``core.runs.run_stream``; the load's waits and the
take-over of another coordinator's agents are ``core.runs.stage_loading``. Callers import
them all from here.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import msgspec

from agents.protocol import (
    AgentState,
    AgentStatus,
    ComputeOptions,
    ConvSweepOptions,
    ErrorReply,
    KvReservation,
    LinkOptions,
    LinkResult,
    LinkShape,
    LoadShard,
    Options,
    PeerSpec,
    StartRun,
    StopRun,
    TimelineEvent,
    Unload,
    options_slot,
)
from agents.accelerators import unavailable_device
from agents.transport import CurveKeys
from core.devices.agent_link import AgentEndpoint, AgentLink
from core.devices.clock_sync import ClockEstimate
from core.errors import DeviceUnavailable, FormatError, HelperLost, PlanInvalid, RunFailed
from core.planning.plan import ShardPlan, layout_problems
from core.runs.batching import run_micro_batches, split_micro_batches  # noqa: F401  (split: public here too)
from core.reporting import NullReporter, Reporter
from core.runs import run_state
from core.runs.batching import kv_reservation
from core.runs.recovery import (
    RecoveryImpossible, RecoveryRecord, Replanner, Resume, keep_stage_settings, resume_point,
)
from core.runs.run_stream import (  # noqa: F401  (public here: callers import them from the coordinator)
    MODES, ActiveRun, FanoutSink, Mode, NullSink, RunRequest, RunResult, RunSink,
)
from core.runs.stage_loading import await_loads, run_failure, take_over
from core.runs.wire import counters_of

__all__ = [
    "MODES", "AgentEndpoint", "ClockEstimate", "Coordinator", "FanoutSink", "Mode", "NullSink", "RunRequest",
    "RunResult", "RunSink", "split_micro_batches",
]


SILENT_AFTER_S = 1.0
"""A failure path with nothing to decide waits at least this long for a run's agent to answer before it stops
waiting on it: a live agent answers a status from its control thread at once, even on a loaded host."""


class Coordinator:
    """Loads and runs plans on a set of agents over one ``AgentLink``. Use as a context manager.

    The link's operations (status, clocks, logs, profiling requests) are offered here too,
    so one object serves the CLI and the GUI; ``link`` is the connection set itself.
    """

    def __init__(
        self,
        endpoints: Sequence[AgentEndpoint],
        keys: CurveKeys,
        *,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 2.0,
        request_timeout_s: float = 10.0,
        lease_s: float = 3.0,
    ) -> None:
        self.link = AgentLink(endpoints, keys, heartbeat_interval_s=heartbeat_interval_s,
                              heartbeat_timeout_s=heartbeat_timeout_s, request_timeout_s=request_timeout_s,
                              on_stream=self._on_stream)
        self.link.add_lost_listener(self._on_agent_lost)
        self.endpoints = self.link.endpoints
        self.keys = keys
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.request_timeout_s = request_timeout_s
        self.lease_s = max(lease_s, 2 * heartbeat_interval_s)
        """How long agents keep a run of this coordinator alive without hearing from it (its
        pings renew the lease); then they abort it, so a killed coordinator orphans nothing."""
        self._run: ActiveRun | None = None
        self._run_lock = threading.Lock()
        self._loaded: tuple[ShardPlan, object] | None = None
        self._loaded_kv = KvReservation()
        self._load_args: dict = {}
        self._last_state: run_state.RunState | None = None
        self._gone: tuple[run_state.RunState, tuple[str, ...]] | None = None
        """The run end a failure path asked about and every agent lost then (``_gone_at``)."""

    # ------------------------------------------------------------------ the link's surface
    def __enter__(self) -> "Coordinator":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        self.link.open()

    def close(self) -> None:
        self.link.close()

    @property
    def on_lost(self) -> Callable[[str], None] | None:
        """Told the device's name (on the IO thread) when an agent is declared lost."""
        return self.link.on_lost

    @on_lost.setter
    def on_lost(self, callback: Callable[[str], None] | None) -> None:
        self.link.on_lost = callback

    def request(self, device: str, msg, timeout_s: float | None = None):
        return self.link.request(device, msg, timeout_s)

    def request_async(self, device: str, msg) -> cf.Future:
        return self.link.request_async(device, msg)

    def status(self, timeout_s: float = 5.0) -> dict[str, AgentStatus]:
        return self.link.status(timeout_s)

    def status_of(self, devices, timeout_s: float = 5.0) -> dict[str, AgentStatus]:
        return self.link.status_of(devices, timeout_s)

    def wait_ready(self, timeout_s: float = 10.0) -> dict[str, AgentStatus]:
        return self.link.wait_ready(timeout_s)

    def sync_clocks(self, samples: int = 8, timeout_s: float = 5.0) -> dict[str, ClockEstimate]:
        return self.link.sync_clocks(samples, timeout_s)

    def clocks(self) -> dict[str, ClockEstimate]:
        return self.link.clocks()

    def logs(self, device: str, lines: int = 200) -> tuple[str, ...]:
        return self.link.logs(device, lines)

    def profile_compute(self, device: str, options: ComputeOptions | ConvSweepOptions, timeout_s: float = 600):
        return self.link.profile_compute(device, options, timeout_s)

    def measure_link(self, src: str, peer: PeerSpec, options: LinkOptions, timeout_s: float = 120) -> LinkResult:
        return self.link.measure_link(src, peer, options, timeout_s)

    # ------------------------------------------------------------------ what the link reports
    def _on_agent_lost(self, device: str, why: str) -> None:
        if self._loaded is not None and device in self._loaded[0].devices():
            self._loaded = None
        run = self._run
        if run is not None and device in run.helpers:  # the stages cannot go on without it
            run.lost_helper = run.lost_helper or (device, why)
            run.advance(run_state.StopRequested(f"agent {device} stopped answering ({why}); the run's "
                                                       "stages need it"))
        elif run is not None:  # an idle agent's loss is only reported (the state machine ignores it)
            run.advance(run_state.AgentLost(device, why))

    def _on_stream(self, device: str, msg) -> None:
        run = self._run
        if run is not None:
            run.take_in(device, msg, self.link.clock_of)

    # ---------------------------------------------------------------- operations
    def load(
        self,
        plan: ShardPlan,
        model_dir: str | dict[str, str],
        *,
        dtype: str = "float32",
        threads: int = 0,
        links: dict[str, LinkShape] | None = None,
        reporter: Reporter | None = None,
        timeout_s: float = 300,
        kv: KvReservation = KvReservation(),
        files: dict[str, tuple[tuple[str, str], ...]] | None = None,
        kind: str | dict[str, str] = "layers",
        options: dict[str, Options] | None = None,
        torch_devices: dict[str, str] | None = None,
    ) -> None:
        """Load every stage of ``plan`` on its agent (in parallel); ``model_dir`` may be per device.

        ``kv`` (``core.runs.batching.kv_reservation``): each stage allocates that KV cache at load, so an emulated
        budget it breaks refuses the load (``ShardOverBudget``) instead of failing mid-run.
        ``files``: per device, the (name, sha256) of weights sent to it (core.runs.weights).
        ``kind``: the stage kind (``agents.executors``) every stage, or each device's stage, is
        loaded as — how a technique's plan reaches its own agent-side executor.
        ``options``: per device, its stage kind's own options (``LoadShard.options``; e.g. the agents an
        attention-offload dense stage calls over the data plane while it computes); a device without
        gets its plan stage's ``Stage.options`` (e.g. expert offloading's buffer settings).
        Each stage's weight precision is the plan's (``Stage.weights`` -> ``LoadShard.weights``).
        ``torch_devices``: per device, where its stage computes (``cpu``, ``cuda``, ``cuda:N``; default: its plan
        stage's ``Stage.torch_device``);
        one its agent does not report (``AgentStatus.accelerators``) is ``DeviceUnavailable`` before any load."""
        reporter = reporter or NullReporter()
        problems = layout_problems(plan)
        if problems:
            raise PlanInvalid(problems)
        missing = [s.device for s in plan.stages if s.device not in self.endpoints]
        if missing:
            raise RunFailed(f"plan uses devices without an agent: {', '.join(missing)}")
        self._loaded = None
        self._load_args = dict(model_dir=model_dir, dtype=dtype, threads=threads, links=links, timeout_s=timeout_s,
                               files=files, kind=kind, options=options, torch_devices=torch_devices)
        # the plan's agents only: another agent that died unnoticed (a long heartbeat timeout) must not fail it
        statuses = self.link.status_of([d for d in plan.devices() if not self.link.is_lost(d)], 5.0)
        lost = [d for d in plan.devices() if d not in statuses]
        if lost:  # the plan's own agent stopped answering before the load (was a KeyError)
            raise RunFailed("its agent stopped answering: start it again, or plan without it", lost[0])
        for i, s in enumerate(plan.stages):  # before anything is stopped or loaded
            refusal = unavailable_device((torch_devices or {}).get(s.device, s.torch_device),
                                         tuple(a.name for a in statuses[s.device].accelerators))
            if refusal:
                raise DeviceUnavailable(f"stage {i} {refusal}", s.device)
        if self._run is None:  # a coordinator's own run is never an orphan
            take_over(self.link, {d: statuses[d] for d in plan.devices() if d in statuses}, self.request_timeout_s)
        peers = tuple(
            PeerSpec(device=s.device, stage=i, data_address=statuses[s.device].data_address,
                     public_key=statuses[s.device].public_key)
            for i, s in enumerate(plan.stages)
        )
        for i, s in enumerate(plan.stages):
            if statuses[s.device].public_key != self.endpoints[s.device].public_key:
                raise RunFailed("agent reports a different public key than the one we connected with", s.device)
        links = links or {}
        futs = {}
        for i, s in enumerate(plan.stages):
            mdir = model_dir[s.device] if isinstance(model_dir, dict) else model_dir
            msg = LoadShard(model_dir=str(mdir), stage=i, start=s.start, end=s.end, peers=peers, dtype=dtype,
                            threads=threads, link=links.get(s.device, LinkShape()), kv=kv,
                            files=(files or {}).get(s.device, ()),
                            kind=kind.get(s.device, "layers") if isinstance(kind, dict) else kind,
                            options=_stage_options(s, (options or {}).get(s.device)),
                            weights=s.weights, torch_device=(torch_devices or {}).get(s.device, s.torch_device))
            futs[s.device] = self.request_async(s.device, msg)
        reporter.status(f"loading {len(futs)} stages")
        await_loads(self.link, futs, timeout_s, reporter)
        self._loaded = (plan, model_dir)
        self._loaded_kv = kv

    @property
    def reserved_kv(self) -> KvReservation:
        """The KV cache the loaded stages reserved (none reserved: they grow theirs)."""
        return self._loaded_kv if self._loaded is not None else KvReservation()

    def is_loaded(self, plan: ShardPlan, model_dir) -> bool:
        """Whether ``plan`` of ``model_dir`` is loaded on live agents (false after a failure,
        which unloads every agent of the plan); ``reserved_kv`` says for which runs. The agents are
        asked: a spatial run of this coordinator (or another's load) may have replaced a stage."""
        if self._loaded != (plan, model_dir) or any(self.link.is_lost(d) for d in plan.devices()):
            return False
        try:
            statuses = self.link.status_of(plan.devices(), 5.0)
        except RunFailed:
            return False
        return all(isinstance(st := statuses[s.device], AgentStatus) and st.state is AgentState.READY
                   and st.held_by == "you" and st.stage == i and tuple(st.units) == (s.start, s.end)
                   for i, s in enumerate(plan.stages))

    def unload(self) -> None:
        self._loaded = None
        for d in self.endpoints:
            if not self.link.is_lost(d):
                self.request(d, Unload())

    def _unload_after_failure(self, devices: list[str], gone: tuple[str, ...] = ()) -> None:
        """A failed run leaves no half-used plan behind: every live agent of it goes back to idle (those
        ``gone``, lost or silent, are told but not waited on: a killed agent never replies)."""
        self._loaded = None
        self._tell_all([(d, Unload()) for d in devices], gone, 10.0, "unloading after the failure")

    def run(
        self,
        plan: ShardPlan,
        request: RunRequest,
        sink: RunSink | None = None,
        reporter: Reporter | None = None,
        *,
        helpers: dict[str, str] | None = None,
        replan: Replanner | None = None,
    ) -> RunResult:
        """Run one generation over the loaded plan; blocks the calling thread (not the IO thread).

        ``helpers``: agents that serve this run outside the plan's stages (attention offloading's
        memory agents), device -> the id their own work was started under: they are stopped
        after the stages, and their events (streamed under this run's id) count until they answer.
        ``replan``: when an agent of the run is lost, re-plan over the survivors with it, load
        the new plan and resume (``core.runs.recovery``); None: the run fails naming the device."""
        if not self._run_lock.acquire(blocking=False):
            raise RunFailed("a run is already in progress on these agents")
        try:
            return self._run_locked(plan, request, sink, reporter, helpers or {}, replan)
        finally:
            self._run_lock.release()

    def _run_locked(self, plan, request, sink, reporter, helpers: dict[str, str], replan) -> RunResult:
        reporter = reporter or NullReporter()
        sink = sink or NullSink()
        if request.mode not in MODES:
            raise FormatError("run request", f"{request.mode!r} is not one of {', '.join(MODES)}", "mode")
        n = len(request.input_ids)
        groups = run_micro_batches(n, plan, request.micro_batches) if n or request.options is None else ()
        run_id = uuid.uuid4().hex[:12]
        devices = [s.device for s in plan.stages]
        lost = [d for d in [*devices, *helpers] if self.link.is_lost(d)]
        if lost:
            raise RunFailed("agent is not answering", lost[0])
        run = ActiveRun(run_id=run_id, t0=time.time(), stages={d: i for i, d in enumerate(devices)}, sink=sink,
                         state=run_state.begin(run_id, tuple(devices), load=False), helpers=frozenset(helpers))
        self._run = run
        t_start = time.perf_counter()
        recoveries: list[RecoveryRecord] = []
        gone: tuple[str, ...] = ()
        try:
            self._start_stages(run, devices, request, groups)
            reporter.status(f"running {request.mode} over {len(devices)} stages")
            expected = request.max_new_tokens * len(groups)
            while True:
                while not run.ended.wait(0.1):
                    if reporter.cancel_requested():
                        run.advance(run_state.StopRequested("run cancelled"))
                        break
                    reporter.progress(run_state.progress(run.state, expected), expected)
                gone = self._gone_at(run.state) if replan is not None else self._unanswered_at(run.state,
                                                                                             [*devices, *helpers])
                self._stop_all(devices, run.run_id, gone)
                end = run.state
                lost = self.lost_with(end, devices) if replan and not reporter.cancel_requested() else ()
                if not lost:
                    break
                plan, devices = self._recover(run, plan, request, groups, replan, recoveries, reporter, lost)
        except BaseException as err:  # KeyboardInterrupt and the like: stop the agents, leave them loaded
            gone = gone or (self._gone_at(run.state) if replan is not None
                            else self._unanswered_at(run.state, [*devices, *helpers]))
            self._stop_all(devices, run.run_id, gone)
            self._stop_helpers(helpers, gone)
            if not isinstance(err, KeyboardInterrupt):
                self._unload_after_failure(devices, gone)
            self._last_state = run.state
            self._run = None
            raise
        self._stop_helpers(helpers, gone)
        end = run.state
        if isinstance(end, run_state.Failed):
            self._unload_after_failure(devices, gone)
        self._last_state = end
        self._run = None
        if not isinstance(end, run_state.Finished):
            if run.lost_helper is not None and isinstance(end, run_state.Aborted):
                device, why = run.lost_helper
                raise HelperLost(f"stopped answering mid-run ({why}); the run's stages needed it, so the run was "
                                 "stopped: restart its agent (or run without it) and start the run again", device)
            raise run_failure(end)
        with run.lock:
            events = tuple(sorted(run.events, key=lambda e: (e.start_s, e.stage)))
            toks = tuple(sorted(run.tokens, key=lambda t: t.t_s))
        tokens = tuple(tuple(t) for t in end.tokens)
        if run.resume is not None:  # micro-batches finished before the failure were not resumed
            tokens = tuple(t if t else run.resume.generated[i] for i, t in enumerate(tokens))
        return RunResult(run_id=run_id, tokens=tokens, events=events, token_events=toks, clocks=self.clocks(),
                         wall_s=time.perf_counter() - t_start, recoveries=tuple(recoveries), plan=plan)

    def lost_with(self, end, devices: list[str]) -> tuple[str, ...]:
        """Every agent lost when the run ``end``ed of a loss, the run's stages' first (none: not recoverable). A
        live stage's error (it noticed its peer gone before the heartbeats did) counts when a stage is lost.
        A server's open run asks it too (``core.serving.cluster_runs``): it recovers its requests itself."""
        if not _of_a_loss(end):
            return ()
        gone = self._gone_at(end)
        lost = (*(d for d in devices if d in gone), *(d for d in gone if d not in devices))
        if end.code == "agent_lost":
            return (end.device, *(d for d in lost if d != end.device))
        return lost if any(d in devices for d in lost) else ()

    def _gone_at(self, end) -> tuple[str, ...]:
        """Every agent lost when the run ``end``ed of a loss (none for another end), asked once at the start of
        the failure path and reused by its stops, unloads and ``lost_with``: a killed agent (its port refuses
        connections) is named at once, where waiting on its stop and unload replies took 5 + 10 s."""
        if not _of_a_loss(end):
            return ()
        known = self._gone
        if known is None or known[0] != end:
            known = self._gone = (end, self.link.not_answering(list(self.endpoints), self.heartbeat_timeout_s))
        return known[1]

    def _unanswered_at(self, end, devices: list[str]) -> tuple[str, ...]:
        """A failure that no re-plan decides on (the run fails naming its device whatever the others say):
        those of the run's agents that do not answer within two heartbeats (at least ``SILENT_AFTER_S``; a
        killed one's port refusing is named sooner) are not waited on. A hung agent (SIGSTOP: connected,
        silent) once held the error back until its heartbeats ran out (30-60 s). Not kept as ``_gone_at``'s:
        a server that re-plans afterwards asks again (``lost_with``)."""
        if not _of_a_loss(end):
            return ()
        wait_s = min(self.heartbeat_timeout_s, max(SILENT_AFTER_S, 2 * self.heartbeat_interval_s))
        return self.link.not_answering(list(devices), wait_s)

    def _recover(self, run: ActiveRun, plan: ShardPlan, request: RunRequest, groups, replan: Replanner,
                 recoveries: list[RecoveryRecord], reporter: Reporter, lost: tuple[str, ...]) -> tuple[ShardPlan, list[str]]:
        """Re-plan without every ``lost`` agent, load the new plan and start the run's next segment
        from where the tokens stopped; returns the new plan and its devices. The run state says
        where this stands (``Recovering``); a failure to recover leaves it ``Failed``."""
        failed = lost[0]
        old = [s.device for s in plan.stages]
        detected = time.time() - run.t0
        run.apply(run_state.Replan(failed))
        with run.lock:
            tokens = list(run.tokens)
        step = max((t.step for t in tokens), default=-1) + 1
        reporter.status(f"{failed} lost at step {step}: re-planning over the survivors")
        usable = tuple(d for d in self.endpoints if d not in lost and not self.link.is_lost(d))
        try:
            if self._load_args.get("files"):
                raise RecoveryImpossible("the run's weights were sent to the agents (--send-weights); a re-plan "
                                         "needs the checkpoint on every device", failed)
            new_plan = keep_stage_settings(plan, replan(plan, failed, usable))
        except RecoveryImpossible as err:
            run.apply(run_state.ReplanImpossible(err.reason))
            raise err from None
        new = [s.device for s in new_plan.stages]
        replanned = time.time() - run.t0
        run.apply(run_state.Replanned(tuple(new)))
        run.emit(TimelineEvent(device=failed, stage=old.index(failed), kind="failure", phase="decode",
                                      step=step, micro_batch=0, start_s=run.last_heard(failed),
                                      end_s=detected))
        run.emit(TimelineEvent(device=failed, stage=old.index(failed), kind="replan", phase="decode",
                                      step=step, micro_batch=0, start_s=detected, end_s=replanned))
        resume = resume_point(request.input_ids, request.attention_mask, groups, tokens,
                              max_new_tokens=request.max_new_tokens, eos_token_ids=request.eos_token_ids,
                              pad_token_id=request.pad_token_id)
        left = request.max_new_tokens - min(resume.first_steps, default=0)
        reporter.status(f"loading {len(new)} stage(s) of the re-planned run")
        try:
            args = dict(self._load_args)
            kind = args.pop("kind")
            if isinstance(kind, dict):  # per device: the new plan's stages say theirs
                kind = {s.device: s.kind for s in new_plan.stages}
            args["options"] = {d: o for d, o in (args["options"] or {}).items() if d in new}
            self.load(new_plan, args.pop("model_dir"), reporter=reporter, files=None, kind=kind,
                      kv=kv_reservation(resume.micro_batches or ((0,),), resume.context_tokens + left)
                      if self._loaded_kv.groups else KvReservation(),
                      **{k: v for k, v in args.items() if k != "files"})
        except RunFailed as err:
            run.apply(run_state.ReplanImpossible(f"loading the re-planned stages failed: {err}"))
            raise
        loaded = time.time() - run.t0
        for i, d in enumerate(new):
            run.emit(TimelineEvent(device=d, stage=i, kind="reload", phase="decode", step=step,
                                          micro_batch=0, start_s=replanned, end_s=loaded))
        at_resume = counters_of(self.link, new)
        segment = uuid.uuid4().hex[:12]
        with run.lock:
            run.resume = resume
            run.stages = {d: i for i, d in enumerate(new)}
            run.ended.clear()
            run.state = run_state.apply(run.state, run_state.Resume(segment))
            run.run_id = segment
        if not resume.micro_batches:  # every micro-batch had finished: nothing left to run
            with run.lock:
                run.state = run_state.Finished(segment, tuple(new), resume.generated)
            run.ended.set()
        else:
            self._start_stages(run, new, request, resume.micro_batches, resume)
        recoveries.append(RecoveryRecord(failed=failed, step=step, detected_s=detected, replanned_s=replanned,
                                         loaded_s=loaded, resumed_s=time.time() - run.t0,
                                         old_stages=tuple(old), new_stages=tuple(new), plan=new_plan,
                                         keys=resume.keys, first_steps=resume.first_steps,
                                         resumed_width=resume.context_tokens, also_lost=lost[1:],
                                         wire_at_resume=at_resume))
        return new_plan, new

    def _start_stages(self, run: ActiveRun, devices: list[str], request: RunRequest, groups,
                      resume: Resume | None = None) -> None:
        """``StartRun`` to every stage, downstream first so they wait when the source's data arrives."""
        keys = resume.keys if resume else ()
        firsts = resume.first_steps if resume else ()
        for i in reversed(range(len(devices))):
            d = devices[i]
            if i == 0:
                run.t0 = run.t0 if resume else time.time()
                msg = StartRun(run_id=run.run_id, mode=request.mode, max_new_tokens=request.max_new_tokens,
                               micro_batches=groups,
                               input_ids=resume.input_ids if resume else request.input_ids,
                               attention_mask=resume.attention_mask if resume else request.attention_mask,
                               eos_token_ids=request.eos_token_ids,
                               pad_token_id=request.pad_token_id, sampling=request.sampling,
                               lease_s=self.lease_s, first_steps=firsts, micro_batch_keys=keys,
                               generated=resume.generated if resume else (), options=options_slot(request.options))
            elif i == len(devices) - 1 and request.sampling.uses_history:  # its sampler looks at the prompts
                msg = StartRun(run_id=run.run_id, mode=request.mode, max_new_tokens=request.max_new_tokens,
                               micro_batches=groups,
                               input_ids=resume.input_ids if resume else request.input_ids,
                               attention_mask=resume.attention_mask if resume else request.attention_mask,
                               sampling=request.sampling, lease_s=self.lease_s, first_steps=firsts,
                               micro_batch_keys=keys)
            else:  # options that every stage runs by (``every_stage``: an open run's) go to each
                msg = StartRun(run_id=run.run_id, mode=request.mode, max_new_tokens=request.max_new_tokens,
                               sampling=request.sampling, lease_s=self.lease_s, first_steps=firsts,
                               micro_batch_keys=keys, options=options_slot(request.options)
                               if getattr(request.options, "every_stage", False) else options_slot(None))
            try:
                reply = self.link.await_reply(d, self.request_async(d, msg), self.request_timeout_s,
                                              "starting the run")
            except RunFailed as err:
                run.advance(run_state.StageRefused(d, err.reason, "no_answer"))
                return
            if isinstance(reply, ErrorReply):  # e.g. nothing loaded (a failure unloaded it): load the plan first
                run.advance(run_state.StageRefused(d, f"cannot start the run ({reply.code}): {reply.message}",
                                                          "busy" if reply.code == "busy" else "refused"))
                return
            run.advance(run_state.StageStarted(d))
            if run.ended.is_set():
                return

    @property
    def active_run(self) -> ActiveRun | None:
        """The run in progress, None between runs (an open run's joins name its id and its clock)."""
        return self._run

    @property
    def latest_run_state(self) -> run_state.RunState | None:
        """Where the current run stands (the last run's end state when none is running)."""
        run = self._run
        return run.state if run is not None else self._last_state

    def _stop_all(self, devices: list[str], run_id: str, gone: tuple[str, ...] = ()) -> None:
        """Tell every live agent to end ``run_id``; their replies come after their last events (``gone``: known lost,
        not asked)."""
        self._tell_all([(d, StopRun(run_id=run_id)) for d in devices], gone, 5.0, "stopping")

    def _stop_helpers(self, helpers: dict[str, str], gone: tuple[str, ...] = ()) -> None:
        self._tell_all([(d, StopRun(run_id=i)) for d, i in helpers.items()], gone, 5.0, "stopping")

    def _tell_all(self, messages: list[tuple[str, object]], gone: tuple[str, ...], timeout_s: float, what: str) -> None:
        """Each message to its agent unless declared lost; the replies of those not ``gone`` awaited. A ``gone``
        one is told anyway and not waited on (a hung agent, not known lost, stops and unloads when it wakes)."""
        futs = [(d, self.request_async(d, m)) for d, m in messages if not self.link.is_lost(d)]
        for d, f in futs:
            if d in gone:
                self.link.forget(f)
                continue
            try:
                self.link.await_reply(d, f, timeout_s, what)
            except RunFailed:
                pass

    def stop(self) -> None:
        """Abort the current run from another thread (the GUI's Stop button)."""
        run = self._run
        if run is not None:
            run.advance(run_state.StopRequested("run stopped by the operator"))


def _of_a_loss(end) -> bool:
    """Whether a run ended on an agent's loss (``agent_lost``) or a stage's error (perhaps its peer's loss)."""
    return isinstance(end, run_state.Failed) and end.code in ("agent_lost", "agent_error")


def _stage_options(stage, given: Options | None) -> msgspec.Raw:
    """A stage's ``LoadShard.options``: those given for its device, else its plan's (``Stage.options``,
    a JSON object the agent decodes strictly by its ``kind`` tag)."""
    if given is not None or stage.options is None:
        return options_slot(given)
    return msgspec.Raw(msgspec.msgpack.encode(stage.options))
