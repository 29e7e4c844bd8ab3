"""The spatial plan view's long work, as worker tasks (``gui.workers.TaskRunner``): a strategy's solve
and Compare (a fused solve took 0.9-1.2 s on the GUI thread under load, freezing the studio as the
technique was picked), and a run on the agents. Each takes a ``Reporter`` first; no widgets here."""

from __future__ import annotations

from dataclasses import dataclass

from core.techniques.spatial.cost import evaluate, single_device_seconds
from core.techniques.spatial.problem import SpatialPlan, SpatialProblem
from core.techniques.spatial.strategies import compare, run_strategy
from gui.widgets import counted


@dataclass(frozen=True)
class Solved:
    """A strategy's outcome for ``problem``: its plan and summary line, or why it found none."""

    problem: SpatialProblem
    strategy: str
    plan: SpatialPlan | None
    summary: str = ""
    error: str = ""


def solve_task(reporter, problem: SpatialProblem, name: str) -> Solved:
    """Worker: ``name``'s plan for ``problem`` and the line that sums it up (latency, speedup, tiles)."""
    reporter.status(f"Solving {name}…")
    out = run_strategy(problem, name)
    if out.plan is None:
        return Solved(problem, name, None, error=out.error)
    one = single_device_seconds(problem)
    cost = evaluate(problem, out.plan)
    summary = (f"{problem.name}: {problem.model.spec().name}. {name}: {cost.latency_s * 1e3:.1f} ms/image, "
               f"{one / cost.latency_s:.2f}× one device ({one * 1e3:.0f} ms), "
               f"{counted(len(out.plan.devices), 'device')}, {counted(len(out.plan.groups), 'tile')}, "
               f"{cost.moved_bytes / 1e6:.1f} MB moved per image" + ("" if cost.fits else " — does NOT fit in memory"))
    return Solved(problem, name, out.plan, summary)


def compare_task(reporter, problem: SpatialProblem) -> list[list[str]]:
    """Worker: every partitioner's row of the comparison table."""
    reporter.status("Comparing every partitioner…")
    one = single_device_seconds(problem)
    return [[o.strategy, f"{o.latency_s * 1e3:.1f}" if o.latency_s else "—",
             f"{one / o.latency_s:.2f}×" if o.latency_s else "—",
             str(len(o.plan.devices)) if o.plan else "—", str(len(o.plan.groups)) if o.plan else "—",
             o.status if not o.error else f"{o.status}: {o.error}"] for o in compare(problem)]


def run_task(reporter, link, problem: SpatialProblem, plan: SpatialPlan, images: int | list[str], workspace: str,
             session: str):
    """Worker: ``images`` (that many seeded random images, or image files) through ``run_and_record``,
    each image reported as it lands."""
    import torch

    from core.techniques.spatial.images import load_images
    from core.techniques.spatial.run import run_and_record

    spec = problem.model.spec()
    if isinstance(images, list):
        reporter.status(f"reading {len(images)} image file(s)")
        images = load_images(images, spec.image)
    else:
        images = torch.randn(images, 3, spec.image, spec.image, generator=torch.Generator().manual_seed(0))
    reporter.status("synchronising clocks")
    link.sync_clocks()
    return run_and_record(link, problem, plan, images, workspace=workspace, session=session, reporter=reporter,
                          on_image=lambda events, _token, result: reporter.partial_result((events, result)))
