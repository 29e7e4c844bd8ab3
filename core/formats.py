"""Versioned JSON files (problem, profile, plan, ...): one loader, one saver, schemas.

Every file carries ``format`` and ``version``. Loading checks those first (so a plan
given where a problem is expected says so), then decodes strictly against the type:
an error names the file, the field (as a JSON path) and the problem, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from core.errors import FormatError

T = TypeVar("T")

# format name -> (type, newest version this program reads); each wing registers its own
FORMATS: dict[str, tuple[type, int]] = {}


def register_format(name: str, typ: type, version: int) -> None:
    """The module defining a format registers it at import (plan, problem, profile, scenario, ...).

    So this shared module imports no wing: whoever holds the type has imported its module.
    """
    FORMATS[name] = (typ, version)


_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)


def _validation_error(source: str, err: Exception) -> FormatError:
    m = _PATH_RE.match(str(err))
    assert m is not None
    return FormatError(source, m.group("msg"), m.group("path"))


def decode(data: bytes | str, typ: type[T], source: str = "<input>") -> T:
    """Decode JSON text into ``typ``, checking format and version when it has them."""
    if isinstance(data, str):
        data = data.encode()
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        raise FormatError(source, f"not valid JSON ({err})") from None
    expected = next((n for n, (t, _) in FORMATS.items() if t is typ), None)
    if expected is not None:
        if not isinstance(raw, dict):
            raise FormatError(source, f"expected a JSON object of format {expected!r}")
        got = raw.get("format")
        if got != expected:
            what = f"a {got!r} file" if got else "a file without a 'format' field"
            raise FormatError(source, f"this is {what}, expected format {expected!r}", "$.format")
        newest = FORMATS[expected][1]
        version = raw.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise FormatError(source, f"version must be a positive integer, got {version!r}", "$.version")
        if version > newest:
            raise FormatError(
                source,
                f"version {version} is newer than this program reads ({newest}); upgrade edgeshard-studio",
                "$.version",
            )
    try:
        return msgspec.convert(raw, typ, strict=True)
    except msgspec.ValidationError as err:
        raise _validation_error(source, err) from None


def load(path: str | os.PathLike, typ: type[T]) -> T:
    """Read and decode a file; every failure is a ``FormatError`` naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as err:
        raise FormatError(str(p), f"cannot read file ({err.strerror or err})") from None
    return decode(data, typ, str(p))


def format_of(path: str | os.PathLike) -> str:
    """The ``format`` field of a JSON file (to accept several kinds of input)."""
    p = Path(path)
    try:
        raw = json.loads(p.read_bytes())
    except OSError as err:
        raise FormatError(str(p), f"cannot read file ({err.strerror or err})") from None
    except ValueError as err:
        raise FormatError(str(p), f"not valid JSON ({err})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("format"), str):
        raise FormatError(str(p), "missing the 'format' field", "$.format")
    return raw["format"]


def encode(value: Any) -> bytes:
    """Pretty, stable JSON (keys in declaration order, 2-space indent, trailing newline)."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2) + b"\n"


def check_writable(path: str | os.PathLike, option: str = "--out", *, folder: bool = False) -> None:
    """Refuse, before any work, an output path that could not be written: for a file (``save``
    makes missing folders) a folder, for a ``folder`` a file; or one below a file or a folder
    this user cannot write to."""
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise FormatError(str(p), "is a file: give a folder", option)
    if not folder and p.is_dir():
        raise FormatError(str(p), "is a folder: give a file name", option)
    parent = p if folder and p.is_dir() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise FormatError(str(p), f"cannot be written ({parent} is not a folder this user may write to)", option)


def save(path: str | os.PathLike, value: Any) -> None:
    """Write atomically (temp file + rename) so a crash never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(value))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; saved files are ordinary documents
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def json_schema(typ: type) -> dict[str, Any]:
    """The JSON Schema of a format, generated from its type (docs/formats.md embeds these)."""
    return msgspec.json.schema(typ)
