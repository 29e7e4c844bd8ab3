"""A planning problem: a profile plus who holds the prompt and what is to be served."""

from __future__ import annotations

from typing import Literal

import msgspec

from core.formats import register_format

from core.devices.profile import Profile

PROBLEM_FORMAT = "edgeshard.problem"
PROBLEM_VERSION = 1


class Workload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt_tokens: int
    generated_tokens: int
    batch_size: int = 1
    """Sequences served together (for throughput: micro_batch_size × micro_batches)."""
    micro_batch_size: int | None = None
    """Fixed micro-batch size; None lets the throughput solver choose it."""
    micro_batches: int | None = None
    """Fixed number of micro-batches in flight; None lets the throughput solver choose."""

    @property
    def context_tokens(self) -> int:
        """Tokens a KV cache must hold per sequence at the end of generation."""
        return self.prompt_tokens + self.generated_tokens


class PlanningProblem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal["edgeshard.problem"] = PROBLEM_FORMAT
    version: int = PROBLEM_VERSION
    name: str = ""
    profile: Profile
    source: str
    """Device that holds the prompt: stage 0 (with the embedding) must run there."""
    workload: Workload
    excluded_devices: tuple[str, ...] = ()
    """Devices the operator does not want used (privacy, maintenance)."""
    memory_headroom: float = 0.0
    """Fraction of every device's budget kept free (0.1 = plan within 90 %); applied by
    ``usable_memory_bytes`` only, for the cost model and the solvers alike."""
    max_perplexity_increase: float | None = None
    """The operator's quality bound: a device may hold its stage's weights at int8/int4 when that
    precision's measured perplexity (``Profile.weight_quality``) is at most this much above fp's
    (0.05 = 5 %); None: every stage at fp (core.planning.precision)."""


def usable_memory_bytes(problem: PlanningProblem, memory_bytes: int) -> int:
    """What a plan may fill of a device's ``memory_bytes`` once the headroom is kept free."""
    return int(memory_bytes * (1.0 - problem.memory_headroom))


def problem_errors(problem: PlanningProblem) -> list[str]:
    """Every inconsistency of a problem beyond its types (see ``profile_errors``)."""
    from core.devices.profile import profile_errors

    out = [e.replace("$.", "$.profile.", 1) for e in profile_errors(problem.profile)]
    ids = set(problem.profile.cluster.device_ids())
    if problem.source not in ids:
        out.append(f"$.source: {problem.source!r} is not a device of the cluster")
    elif problem.source not in {t.device for t in problem.profile.times}:
        out.append(f"$.source: no compute times for {problem.source!r}")
    wl = problem.workload
    if wl.prompt_tokens < 1:
        out.append("$.workload.prompt_tokens: must be at least 1")
    if wl.generated_tokens < 0:
        out.append("$.workload.generated_tokens: must not be negative")
    if wl.batch_size < 1:
        out.append("$.workload.batch_size: must be at least 1")
    for name in ("micro_batch_size", "micro_batches"):
        v = getattr(wl, name)
        if v is not None and not 1 <= v <= wl.batch_size:
            out.append(f"$.workload.{name}: must be between 1 and the batch size ({wl.batch_size})")
    if wl.micro_batch_size and wl.micro_batches and wl.micro_batch_size * wl.micro_batches > wl.batch_size:
        out.append("$.workload: micro_batch_size × micro_batches exceeds batch_size")
    if not 0.0 <= problem.memory_headroom < 1.0:
        out.append("$.memory_headroom: must be in [0, 1)")
    bound = problem.max_perplexity_increase
    if bound is not None:
        if not 0.0 <= bound < float("inf"):
            out.append("$.max_perplexity_increase: must be a finite fraction >= 0 (0.05 = 5 %)")
        elif not any(q.weights == "fp" for q in problem.profile.weight_quality):
            out.append("$.max_perplexity_increase: the profile has no perplexity per weight precision; measure it "
                       "once with `edgeshard measure-precision` (or plan without a quality bound)")
    return out


def check_problem(problem: PlanningProblem, source: str = "<problem>") -> PlanningProblem:
    """Raise ``FormatError`` (file, field, problem) for the first inconsistency; return the problem."""
    from core.errors import FormatError

    errors = problem_errors(problem)
    if errors:
        field, _, msg = errors[0].partition(": ")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise FormatError(source, msg + more, field)
    return problem


DEFAULT_GENERATED_TOKENS = 32
"""Tokens generated per sequence when nobody said otherwise (the profile does not know)."""
DEFAULT_PROMPT_TOKENS = 32
"""Prompt length when the profile does not record the one it was measured with."""

_CHANGEABLE = ("name", "source", "workload", "excluded_devices", "memory_headroom", "max_perplexity_increase")


def default_problem(profile: Profile, source: str | None = None, workload: Workload | None = None) -> PlanningProblem:
    """The problem a fresh profile starts as: served from ``source`` (default: the first device
    with compute times), the profiled prompt length and batch, ``DEFAULT_GENERATED_TOKENS``.

    Raises ``FormatError`` naming the field if ``source`` or ``workload`` do not fit the profile.
    """
    if source is None:
        timed = {t.device for t in profile.times}
        source = next((d for d in profile.cluster.device_ids() if d in timed), None)
        if source is None:
            from core.errors import FormatError

            raise FormatError("profile", "no device has compute times: profile the devices first", "$.times")
    if workload is None:
        pw = profile.profiled_workload
        workload = Workload(prompt_tokens=pw.prompt_tokens if pw else DEFAULT_PROMPT_TOKENS,
                            generated_tokens=DEFAULT_GENERATED_TOKENS, batch_size=pw.batch_size if pw else 1)
    problem = PlanningProblem(name=profile.model.name, profile=profile, source=source, workload=workload)
    return _check_fields(problem, ("source", "workload"))


def with_changes(problem: PlanningProblem, **fields) -> PlanningProblem:
    """``problem`` with some of its fields replaced (source, workload, excluded devices, headroom,
    name), checked: a wrong type or value raises ``FormatError`` naming the field, so an invalid
    workload or headroom never reaches the solvers."""
    import msgspec.structs

    from core.errors import FormatError

    types = {f.name: f.type for f in msgspec.structs.fields(PlanningProblem)}
    converted = {}
    for name, value in fields.items():
        if name not in _CHANGEABLE:
            raise FormatError("problem", f"{name!r} cannot be changed (changeable: {', '.join(_CHANGEABLE)})",
                              f"$.{name}")
        try:
            converted[name] = msgspec.convert(value, types[name])
        except msgspec.ValidationError as err:
            raise FormatError("problem", str(err), f"$.{name}") from None
    return _check_fields(msgspec.structs.replace(problem, **converted), tuple(converted))


def _check_fields(problem: PlanningProblem, changed: tuple[str, ...]) -> PlanningProblem:
    """Raise ``FormatError`` for the first inconsistency in a ``changed`` field."""
    from core.errors import FormatError

    errors = [e for e in problem_errors(problem) if any(e.startswith(f"$.{name}") for name in changed)]
    if "excluded_devices" in changed:
        ids = set(problem.profile.cluster.device_ids())
        errors += [f"$.excluded_devices: {d!r} is not a device of the cluster"
                   for d in problem.excluded_devices if d not in ids]
    if errors:
        field, _, msg = errors[0].partition(": ")
        raise FormatError("problem", msg, field)
    return problem


register_format(PROBLEM_FORMAT, PlanningProblem, PROBLEM_VERSION)


def without_offline(problem: PlanningProblem, offline) -> PlanningProblem:
    """``problem`` with the offline devices of its cluster excluded, so a solver never counts on
    them. An offline source cannot be left out (it holds the prompt): ``PlanInvalid`` says so."""
    from core.errors import PlanInvalid

    ids = problem.profile.cluster.device_ids()
    down = [d for d in ids if d in set(offline) and d not in problem.excluded_devices]
    if problem.source in set(offline):
        raise PlanInvalid([f"the source device {problem.source!r} is offline: it holds the prompt and stage 0; "
                           "bring it back or choose another source"])
    if not down:
        return problem
    return msgspec.structs.replace(problem, excluded_devices=(*problem.excluded_devices, *down))
