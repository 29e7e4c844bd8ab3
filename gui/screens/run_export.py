"""Exporting a recorded run from the Sessions screen (a worker job): its trace as Perfetto /
chrome://tracing JSON (named by its technique: ``gui.screens.run_names``) or CSV, its plan or its
profile, in the files the CLI reads."""

from __future__ import annotations

from core.reporting import Reporter
from core.sessions.store import SessionStore
from gui.screens.run_names import run_name, run_technique


def export_run(reporter: Reporter, workspace: str, run_id: int, what: str, path: str) -> tuple[str, str]:
    """Worker job: write a run's trace (Chrome JSON, or CSV by extension), plan or profile."""
    from core import formats
    from core.errors import StoreError
    from core.sessions.export import write_chrome_trace, write_events_csv

    with SessionStore(workspace) as store:
        run = store.run(run_id)
        if what == "trace":
            items = store.timeline(run_id)
            events = [i.event for i in items if i.event is not None]
            tokens = [i.tokens for i in items if i.tokens is not None]
            if path.lower().endswith(".csv"):
                write_events_csv(path, events)
            else:
                problem = store.problem_of(run_id)
                write_chrome_trace(path, events, tokens, source_device=problem.source if problem else None,
                                   metadata={"run": run.id, "name": run_name(run), "technique": run_technique(run),
                                             "mode": run.mode, "kind": run.kind, "model": run.model})
        elif what == "plan":
            if run.plan_id is None:
                raise StoreError(f"run {run.id} has no plan stored")
            formats.save(path, store.plan(run.plan_id))
        elif what == "profile":
            if run.profile_id is None:
                raise StoreError(f"run {run.id} has no profile stored")
            formats.save(path, store.profile(run.profile_id))
        else:
            raise ValueError(what)
    return what, path
