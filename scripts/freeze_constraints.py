"""Write constraints.txt: the installed version of every package the project and its [test]
extra pull (pyproject.toml's dependencies, followed through each package's own requirements).

Run it with the interpreter the whole suite just passed with, after adding or moving a
dependency:  python scripts/freeze_constraints.py  (then commit constraints.txt with the change).
A local build label is dropped (torch 2.13.0+cpu -> torch==2.13.0: pip takes the CPU wheel on disk).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# The exact versions the whole suite passes with (Python 3.11, Debian 12): every package the
# project and its [test] extra pull, as installed where it passed. The Makefile installs with
# `pip install -c constraints.txt`, so a set-up is reproducible. torch==2.13.0 is the CPU wheel
# (pip takes the one on disk; a CUDA build is never pulled).
# Written by scripts/freeze_constraints.py: change a dependency, run `make test`, run the script,
# commit both together.
"""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_closure(requirements: list[str], extras: set[str]) -> dict[str, str]:
    """Installed name -> version for ``requirements`` and everything they require, transitively."""
    env = {"extra": ""}
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in (active or {""})):
            continue
        key = _key(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            sys.exit(f"{req.name} is not installed here: install the project first (make install-test)")
        if (key, frozenset(req.extras)) in seen:
            continue
        seen.add((key, frozenset(req.extras)))
        found[key] = dist.version.split("+", 1)[0]
        todo += [(Requirement(r), set(req.extras)) for r in dist.requires or []]
    return found


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = pinned_closure(requirements, set())
    pins.pop("pip", None)
    (ROOT / "constraints.txt").write_text(HEADER + "".join(f"{k}=={v}\n" for k, v in sorted(pins.items())))
    print(f"constraints.txt: {len(pins)} packages")


if __name__ == "__main__":
    main()
