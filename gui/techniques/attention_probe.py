"""The memory agents' attention probed before a measured attention-offloading plan's first run.

A layer-sharding profile never times the attention a memory agent performs (per frame: the KV
append, SDPA, the answer); without it the Run screen predicted the demo's memory lanes at a few
per cent of what they measured. ``core.techniques.attention_offload.probe`` measures it with a
short run of the technique; this runs it on a worker, once per profile, checkpoint and roles.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject

from gui.workers import TaskRunner


def probe_job(reporter, coordinator, problem, model_dir: str, compute: str, memory: list[str]):
    """The worker's job: ``probe_on_agents`` (its ``ProbeFit``)."""
    from core.techniques.attention_offload.probe import probe_on_agents

    reporter.status(f"measuring the attention of {', '.join(memory)}")
    return probe_on_agents(coordinator, problem, model_dir, compute, memory, reporter=reporter)


class Same:
    """A key part equal only to the very same object, and holding it: a key of ``id(profile)`` alone
    could be matched by a later profile that Python gave the freed one's id (a stale fit)."""

    __slots__ = ("obj",)

    def __init__(self, obj) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


class AttentionProbe(QObject):
    """Probes once per key and hands each caller the fit (or, when the probe failed, None and why)."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.fits: dict[tuple, object] = {}
        """key -> ``probe.ProbeFit``, kept for the later runs of the same profile, checkpoint and roles."""
        self.runner = TaskRunner(self, name="attention-probe")
        self._waiting: tuple[tuple, Callable] | None = None
        self.runner.task_finished.connect(lambda _id, fit: self._done(fit, ""))
        self.runner.task_failed.connect(lambda _id, why: self._done(None, why))

    def measure_then(self, key: tuple, then: Callable[[object, str], None], coordinator, problem, model_dir: str,
                     compute: str, memory: list[str]) -> bool:
        """Call ``then(fit, why)`` with the kept fit for ``key`` now (False), or after a probe on a worker (True)."""
        if key in self.fits:
            then(self.fits[key], "")
            return False
        self._waiting = (key, then)
        self.runner.start(probe_job, coordinator, problem, model_dir, compute, memory)
        return True

    def _done(self, fit, why: str) -> None:
        if self._waiting is None:
            return
        (key, then), self._waiting = self._waiting, None
        if fit is not None:
            self.fits[key] = fit
        then(fit, why)
