"""`edgeshard experiment NAME`: the paper's experiments in simulation (core.runs.experiments).

Registered from the planning group's ``register`` (no entry point of its own): prints the
table and the findings, writes the CSV and the figures (PNG + SVG) to ``--out``.
"""

from __future__ import annotations

import argparse

from core.arguments import float_in
from core.reporting import NullReporter
from core.runs.experiments import EXPERIMENTS, format_result, run_experiment, write_outputs


class _StderrProgress(NullReporter):
    """Long experiments say what they are doing on stderr; stdout stays the table."""

    def status(self, text: str) -> None:
        import sys

        print(f"… {text}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("experiment", help="reproduce one of the EdgeShard paper's experiments (in simulation; miniature: measured)",
                       description="Run a paper experiment on the faithful scenario: print the table and which "
                                   "findings hold; write CSV and PNG/SVG figures.")
    e.add_argument("name", choices=sorted(EXPERIMENTS), help="table-iv, bandwidth (Figs 7-8), source (Fig 9), "
                   "pipelines (Fig 10), algorithms (the paper's Algorithms 1 and 2 vs the exact solvers), "
                   "miniature (the paper's setup on a netns testbed, run for real beside its prediction; needs root)")
    e.add_argument("--out", default="experiments", metavar="DIR", help="where the CSV and figures go (default ./experiments)")
    e.add_argument("--time-limit", type=float_in(0, 86_400, lo_open=True), default=30.0, metavar="S", help="exact search budget per solve (default 30 s)")
    e.add_argument("--quiet", action="store_true", help="no progress on stderr")
    e.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:
    from core.formats import check_writable

    check_writable(args.out, folder=True)  # written after the experiment, which may take minutes
    reporter = None if args.quiet else _StderrProgress()
    result = run_experiment(args.name, reporter, args.time_limit)
    print(format_result(result))
    paths = write_outputs(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0
