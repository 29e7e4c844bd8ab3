"""What a run is: its states and the one pure function that moves between them.

The coordinator feeds ``apply`` everything that bears on a run — what agents stream
(``EventBatch``, ``TokensProduced``, ``RunFinished``, ``RunError``), the replies it awaits
(a stage loaded or started, a request refused) and what it notices itself (an agent lost,
the operator's stop) — and acts on the state that comes back. Leases and recovery build
on the same states, so this module is the single place that says where a run stands.

``apply`` never raises: a message that cannot happen in the current state (tokens before
the shards are loaded, a run finishing before it was started) turns the run into
``Failed(code="protocol")`` naming the device that sent it; messages of another run and
anything after a terminal state leave the state unchanged.

Recovery (``--on-failure replan``): the one way out of a terminal state is ``Replan`` on a
run that ``Failed`` because an agent was lost. The run is then ``Recovering`` (re-planning,
loading the new shards) until ``Resume`` starts its next segment under a new run id (the
interrupted segment's stragglers are ignored) or ``ReplanImpossible`` fails it for good.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Union

from agents.protocol import EventBatch, RunError, RunFinished, TokensProduced

# ---------------------------------------------------------------------------- states


@dataclass(frozen=True)
class Loading:
    """The plan's shards are being loaded on its stages (only when not loaded already)."""

    run_id: str
    stages: tuple[str, ...]
    loaded: frozenset[str] = frozenset()
    fractions: tuple[float, ...] = ()
    """Per stage (in ``stages`` order), the fraction of its shard read so far."""

    @property
    def done(self) -> float:
        return sum(1.0 if d in self.loaded else f for d, f in zip(self.stages, self._fractions()))

    @property
    def total(self) -> int:
        return len(self.stages)

    def _fractions(self) -> tuple[float, ...]:
        return self.fractions or (0.0,) * len(self.stages)


@dataclass(frozen=True)
class Starting:
    """``StartRun`` sent (downstream stages first); waiting for every stage to accept it."""

    run_id: str
    stages: tuple[str, ...]
    started: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Prefill:
    """Every stage runs; the prompts are going through the pipeline (no decode step yet)."""

    run_id: str
    stages: tuple[str, ...]
    tokens: int = 0
    """Token events received so far (step 0: the first token of each micro-batch)."""


@dataclass(frozen=True)
class Decoding:
    run_id: str
    stages: tuple[str, ...]
    step: int
    """The furthest decode step any stage has reached (micro-batches may be at different steps)."""
    tokens: int = 0


@dataclass(frozen=True)
class Finished:
    run_id: str
    stages: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    """Generated ids per sequence (up to and including EOS)."""


FailureCode = Literal["agent_lost", "agent_error", "refused", "busy", "over_budget", "no_answer", "protocol",
                      "no_plan", "no_device"]


@dataclass(frozen=True)
class Failed:
    run_id: str
    stages: tuple[str, ...]
    reason: str
    device: str = ""
    """The device the failure is attributed to ("" when none is)."""
    code: FailureCode = "agent_error"


@dataclass(frozen=True)
class Aborted:
    """Ended on purpose (the operator's stop, a cancelled reporter): the shards stay loaded."""

    run_id: str
    stages: tuple[str, ...]
    reason: str = "run stopped by the operator"


@dataclass(frozen=True)
class Recovering:
    """An agent of the run was lost; the run goes on over the survivors once re-planned and loaded."""

    run_id: str
    """The interrupted segment's id (its late messages are ignored)."""
    stages: tuple[str, ...]
    """The interrupted plan's stages."""
    failed: str
    reason: str
    new_stages: tuple[str, ...] = ()
    """The re-planned stages (empty while re-planning)."""

    @property
    def phase(self) -> str:
        return "loading" if self.new_stages else "replanning"

    def device_lost_text(self) -> str:
        return f"{self.failed} was lost ({self.reason})"


RunState = Union[Loading, Starting, Prefill, Decoding, Recovering, Finished, Failed, Aborted]
TERMINAL = (Finished, Failed, Aborted)


def is_terminal(state: RunState) -> bool:
    return isinstance(state, TERMINAL)


# ---------------------------------------------------------------------------- what happens


@dataclass(frozen=True)
class StageLoaded:
    device: str


@dataclass(frozen=True)
class LoadProgress:
    device: str
    fraction: float


@dataclass(frozen=True)
class StageStarted:
    device: str


@dataclass(frozen=True)
class StageRefused:
    """A load or start was refused by the agent, or not answered in time."""

    device: str
    reason: str
    code: FailureCode = "refused"


@dataclass(frozen=True)
class AgentLost:
    device: str
    reason: str


@dataclass(frozen=True)
class StopRequested:
    reason: str = "run stopped by the operator"


@dataclass(frozen=True)
class FromAgent:
    """A message an agent streamed during the run, with the device it came from."""

    device: str
    message: EventBatch | TokensProduced | RunFinished | RunError


@dataclass(frozen=True)
class Replan:
    """Recover a run that failed because ``Failed.device`` was lost (``--on-failure replan``), or because
    ``lost`` was while a live agent's error ended the run (a stage that noticed its peer gone first)."""

    lost: str = ""


@dataclass(frozen=True)
class Replanned:
    """A plan over the survivors was found; its shards are being loaded on ``stages``."""

    stages: tuple[str, ...]


@dataclass(frozen=True)
class ReplanImpossible:
    """No plan fits the survivors (or loading it failed): the run fails for good."""

    reason: str


@dataclass(frozen=True)
class Resume:
    """The new shards are loaded; the run goes on as segment ``run_id``."""

    run_id: str


RecoveryInput = Union[Replan, Replanned, ReplanImpossible, Resume]
RunInput = Union[StageLoaded, LoadProgress, StageStarted, StageRefused, AgentLost, StopRequested, FromAgent,
                 Replan, Replanned, ReplanImpossible, Resume]


# ---------------------------------------------------------------------------- transitions


def progress(state: RunState, expected: int) -> int:
    """Tokens towards ``expected`` (a run's progress bar): a finished run is complete, and a
    state that counts none (loading, failed) is at 0. Finished holds the token ids, not a count."""
    if isinstance(state, Finished):
        return expected
    tokens = getattr(state, "tokens", 0)
    return min(tokens, expected) if isinstance(tokens, int) else 0


def begin(run_id: str, stages: tuple[str, ...], *, load: bool) -> RunState:
    """The first state of a run over ``stages``: ``Loading`` when the shards must be loaded."""
    stages = tuple(stages)
    if load:
        return Loading(run_id, stages, fractions=(0.0,) * len(stages))
    return Starting(run_id, stages)


def apply(state: RunState, event: RunInput) -> RunState:
    """The state after ``event``; never raises (see the module docstring)."""
    if isinstance(event, Replan):
        if isinstance(state, Failed) and state.code == "agent_lost" and event.lost in ("", state.device):
            return Recovering(state.run_id, state.stages, state.device, state.reason)
        if isinstance(state, Failed) and state.code == "agent_error" and event.lost:
            why = f"{state.device} reported: {state.reason}" if state.device else state.reason
            return Recovering(state.run_id, state.stages, event.lost, why)
        return state
    if is_terminal(state):
        return state
    if isinstance(state, Recovering) or isinstance(event, (Replanned, ReplanImpossible, Resume)):
        return _recovery_step(state, event)
    if isinstance(event, StopRequested):
        return Aborted(state.run_id, state.stages, event.reason)
    if isinstance(event, AgentLost):
        if event.device not in state.stages:  # an idle agent's loss does not end the run
            return state
        return Failed(state.run_id, state.stages, f"agent stopped answering ({event.reason})", event.device,
                      "agent_lost")
    if isinstance(event, StageRefused):
        if event.device not in state.stages:
            return state
        return Failed(state.run_id, state.stages, event.reason, event.device, event.code)
    if isinstance(event, FromAgent):
        return _from_agent(state, event.device, event.message)
    if isinstance(event, (StageLoaded, LoadProgress)):
        return _load_step(state, event)
    if isinstance(event, StageStarted):
        return _start_step(state, event)
    return _illegal(state, "", f"unexpected input {type(event).__name__}")


def _illegal(state: RunState, device: str, what: str) -> Failed:
    return Failed(state.run_id, state.stages, f"{what} while {type(state).__name__.lower()}", device, "protocol")


def _load_step(state: RunState, event: StageLoaded | LoadProgress) -> RunState:
    if event.device not in state.stages:
        return _illegal(state, event.device, "a device outside the plan reported loading")
    if not isinstance(state, Loading):
        if isinstance(event, LoadProgress):  # a status poll answered late: harmless
            return state
        return _illegal(state, event.device, "a stage reported its shard loaded")
    i = state.stages.index(event.device)
    fractions = list(state._fractions())
    if isinstance(event, LoadProgress):
        fractions[i] = max(fractions[i], min(1.0, max(0.0, event.fraction)))
        return replace(state, fractions=tuple(fractions))
    fractions[i] = 1.0
    loaded = state.loaded | {event.device}
    if loaded == set(state.stages):
        return Starting(state.run_id, state.stages)
    return replace(state, loaded=loaded, fractions=tuple(fractions))


def _start_step(state: RunState, event: StageStarted) -> RunState:
    if event.device not in state.stages:
        return _illegal(state, event.device, "a device outside the plan reported starting")
    if isinstance(state, Loading):
        return _illegal(state, event.device, "a stage started")
    if isinstance(state, Starting):
        started = state.started | {event.device}
        if started == set(state.stages):
            return Prefill(state.run_id, state.stages)
        return replace(state, started=started)
    return state  # a late acknowledgement: the stage's events already arrived


def _from_agent(state: RunState, device: str, msg) -> RunState:
    if not isinstance(msg, (EventBatch, TokensProduced, RunFinished, RunError)):
        return _illegal(state, device, f"{type(msg).__name__} arrived as run news")
    if msg.run_id != state.run_id:
        return state  # an earlier run's late message
    if isinstance(msg, RunError):
        return Failed(state.run_id, state.stages, msg.message, msg.device or device, "agent_error")
    if isinstance(state, Loading):
        return _illegal(state, device, f"{type(msg).__name__} arrived")
    if isinstance(msg, RunFinished):
        return Finished(state.run_id, state.stages, msg.tokens)
    if isinstance(msg, EventBatch):
        step = max((e.step for e in msg.events if e.phase == "decode"), default=0)
        return _advance(state, step, tokens=0)
    return _advance(state, msg.step, tokens=1)


def _advance(state: Starting | Prefill | Decoding, step: int, tokens: int) -> RunState:
    """Streamed work of decode step ``step`` (0: prefill): the run is at least that far."""
    seen = getattr(state, "tokens", 0) + tokens
    current = state.step if isinstance(state, Decoding) else 0
    if step >= 1 or isinstance(state, Decoding):
        return Decoding(state.run_id, state.stages, max(current, step), seen)
    return Prefill(state.run_id, state.stages, seen)


def _recovery_step(state: RunState, event: RunInput) -> RunState:
    if not isinstance(state, Recovering):
        return _illegal(state, "", f"{type(event).__name__} outside a recovery")
    if isinstance(event, StopRequested):
        return Aborted(state.run_id, state.stages, event.reason)
    if isinstance(event, Replanned):
        if state.new_stages or state.failed in event.stages or not event.stages:
            return _illegal(state, "", "a re-plan that uses the lost device or comes twice")
        return replace(state, new_stages=tuple(event.stages))
    if isinstance(event, ReplanImpossible):
        return Failed(state.run_id, state.stages, f"{state.device_lost_text()}; cannot recover: {event.reason}",
                      state.failed, "no_plan")
    if isinstance(event, Resume):
        if not state.new_stages:
            return _illegal(state, "", "a resume before a re-plan")
        return Starting(event.run_id, state.new_stages)
    if isinstance(event, (AgentLost, StageRefused)):
        if event.device not in state.new_stages:  # the interrupted plan's other agents may go too
            return state
        return Failed(state.run_id, state.new_stages, f"{event.device} lost while recovering ({event.reason})",
                      event.device, "agent_lost")
    return state  # the interrupted segment's late news, load progress: nothing to do
