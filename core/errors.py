"""Typed errors that carry what the operator needs to fix the problem.

Every error a user can cause (a bad file, an unreachable host, a plan that does not
fit) is an ``EdgeShardError``: the CLI prints its message and exits non-zero, the GUI
shows it in a dialog. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class EdgeShardError(Exception):
    """Base of all operator-facing errors; ``str(err)`` is the message to show."""

    exit_code = 2


class FormatError(EdgeShardError):
    """A file or message does not match its format: names the source, field and problem."""

    def __init__(self, source: str, problem: str, field: str | None = None):
        self.source = source
        self.field = field
        self.problem = problem
        where = f" at {field}" if field else ""
        super().__init__(f"{source}: invalid{where}: {problem}")


class UnsupportedModelError(EdgeShardError):
    """An HF config of a family we cannot plan or run, or missing a needed key."""


class PlanInvalid(EdgeShardError):
    """A plan that breaks one or more rules; ``violations`` lists every one."""

    def __init__(self, violations: list[str]):
        self.violations = list(violations)
        super().__init__("plan is invalid:\n  - " + "\n  - ".join(self.violations))


class ModelDoesNotFit(EdgeShardError):
    """No plan under the rules fits in memory; says how many bytes are missing."""

    def __init__(self, message: str, missing_bytes: int):
        self.missing_bytes = missing_bytes
        super().__init__(message)


class DeployError(EdgeShardError):
    """A device could not be reached, authenticated, prepared or started."""

    def __init__(self, device: str, message: str, hint: str = ""):
        self.device = device
        self.hint = hint
        super().__init__(f"{device}: {message}" + (f"\n  hint: {hint}" if hint else ""))


class RunFailed(EdgeShardError):
    """A partitioned run ended early; names the device that failed and why."""

    def __init__(self, message: str, device: str | None = None):
        self.device = device
        self.reason = message
        """The message without the device's name in front."""
        super().__init__(message if device is None else f"{device}: {message}")


class ShardOverBudget(RunFailed):
    """An agent refused a shard beyond its memory budget: the plan must put fewer units on
    that device (re-profile so the solver sees the budget, then solve again)."""


class DeviceUnavailable(RunFailed):
    """A stage was asked to compute on a CUDA device its agent does not have (``LoadShard.torch_device``):
    nothing was loaded; place that stage on cpu or on a GPU the agent reports (its status' accelerators)."""


class AgentBusy(RunFailed):
    """An agent refused work because it serves another run or session (a spatial run, an attention
    hold, a layer-sharded run) or holds another coordinator's stage; the message says which, whose
    and how it ends. Nothing was started: the operator waits, or stops that work first."""


class HelperLost(RunFailed):
    """An agent that served a run outside its stages (``Coordinator.run(helpers=)``: an attention
    offload memory agent, a held compute replica) stopped answering mid-run. What it held (a KV
    cache) is gone with it, so the run cannot resume: the message names it and says what to do;
    the run's other agents were stopped and are free for the next run."""


class MemoryAgentLost(HelperLost):
    """An attention-offloading memory agent died mid-run (``device``), found by the coordinator's
    heartbeats or by its dense agents when its data connection dropped: restart it, or run on
    the other memory agents."""


class AgentVersionMismatch(RunFailed):
    """An agent speaks another wire protocol version than this studio (older or newer code on
    the device): nothing it says can be trusted to mean the same, so the link refuses it and
    the operator redeploys the studio's agent (``edgeshard agents upgrade``)."""

    def __init__(self, device: str, received: object, supported: int, hint: str):
        self.received = received
        self.supported = supported
        super().__init__(f"the agent speaks protocol version {received}, this studio speaks version {supported}: "
                         f"{hint}", device)


class StoreError(EdgeShardError):
    """A workspace file that cannot be opened, migrated or written."""
