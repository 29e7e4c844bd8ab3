"""The ``edgeshard`` command: a thin argparse front over core's functions.

Sub-commands are plugins found through the ``edgeshard.commands`` entry point group,
each a ``register(subparsers)`` that adds its parsers and sets ``func``. That keeps the
layering (core never imports gui; the GUI registers ``studio`` itself).
An ``EdgeShardError`` is printed as a message and exits non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from core.errors import EdgeShardError, PlanInvalid


class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line naming the option and what is allowed, exit status 2 (not
    the whole usage text, which buries the reason)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


GROUP_OF_COMMAND = {"run": "runtime", "cluster": "runtime", "agent": "runtime"}
"""Commands that a group not named after them registers: ``build_parser`` loads that group alone
for them too (``edgeshard run`` answers a bad plan in under a second: every group and technique
costs ~0.3 s of imports idle, ~1 s on a loaded host). A wrong entry costs only that time."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; or, when ``command`` is the name of a command group that
    registers a command of that name (``studio``, ``sessions``), that group's alone: loading
    every group and technique costs ~0.3 s of imports, which ``edgeshard studio --demo``
    would spend before starting its agents."""
    parser = _OneLineParser(
        prog="edgeshard",
        description="EdgeShard Studio: run one LLM collaboratively across edge devices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups = sorted(entry_points(group="edgeshard.commands"), key=lambda e: e.name)
    alone = [ep for ep in groups if ep.name == GROUP_OF_COMMAND.get(command or "", command)]
    if alone:
        alone[0].load()(sub)
        if command in sub.choices:
            return parser
        return build_parser()  # the group registers other commands: parse with every one
    for ep in groups:
        ep.load()(sub)
    if "serve" not in sub.choices:  # `edgeshard serve` (core.cli.serve) until the installed metadata names it
        from core.cli.serve import register as register_serve

        register_serve(sub)
    from core.techniques import techniques  # a technique's own verbs (Technique.register_cli)

    for technique in techniques():
        if technique.register_cli is not None:
            technique.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PlanInvalid as err:  # one line, every violation: the reason must not scroll away
        print(f"edgeshard: error: plan is invalid: {'; '.join(err.violations)}", file=sys.stderr)
        return err.exit_code
    except EdgeShardError as err:
        print(f"edgeshard: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("edgeshard: interrupted", file=sys.stderr)
        return 130
    except OSError as err:  # a read-only workspace, a full disk, a vanished file: the OS said why
        where = f" ({err.filename})" if err.filename else ""
        print(f"edgeshard: error: {err.strerror or err}{where}", file=sys.stderr)
        return 1

