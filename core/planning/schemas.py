"""The JSON Schemas of the planner's file formats, embedded in docs/formats.md.

Lives in planning (not in the shared ``core.formats``) because it must import every
documented format's module so that each has registered itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import core.devices.profile  # noqa: F401  (each documented format registers itself on import)
import core.planning.plan  # noqa: F401
import core.planning.problem  # noqa: F401
import core.planning.scenarios  # noqa: F401
from core.formats import FORMATS, json_schema

SCHEMA_BEGIN = "<!-- BEGIN GENERATED SCHEMAS (python -m core.planning.schemas docs/formats.md) -->"
SCHEMA_END = "<!-- END GENERATED SCHEMAS -->"

DOCUMENTED_FORMATS = ("edgeshard.problem", "edgeshard.profile", "edgeshard.plan", "edgeshard.scenario")


def schemas_markdown(names: tuple[str, ...] = DOCUMENTED_FORMATS) -> str:
    """The JSON Schemas of the planner's formats, as Markdown."""
    parts = []
    for name in names:
        typ, version = FORMATS[name]
        schema = json.dumps(json_schema(typ), indent=2, sort_keys=True)
        parts.append(f"### `{name}` (version {version})\n\n```json\n{schema}\n```\n")
    return "\n".join(parts)


def embed_schemas(doc_path: str | os.PathLike) -> None:
    """Rewrite the generated block of a Markdown file with the current schemas."""
    p = Path(doc_path)
    text = p.read_text()
    head, _, rest = text.partition(SCHEMA_BEGIN)
    _, _, tail = rest.partition(SCHEMA_END)
    p.write_text(f"{head}{SCHEMA_BEGIN}\n\n{schemas_markdown()}\n{SCHEMA_END}{tail}")


if __name__ == "__main__":  # python -m core.planning.schemas docs/formats.md
    import sys

    embed_schemas(sys.argv[1] if len(sys.argv) > 1 else "docs/formats.md")
