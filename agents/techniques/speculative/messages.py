"""Speculative decoding's wire: the ``StartRun`` options that make a run speculative and the two
data kinds of a verify trip (the proposed tokens down the stages, the target's verdict back)."""

from __future__ import annotations

from typing import ClassVar

from agents.envelope import Message, Options

MAX_SPECULATE = 64
"""The most draft tokens one verify trip may carry."""

VERIFY = "verify"
"""Data kind: ``n`` tokens (the last committed one and the draft's proposals) on their way through
the stages; every stage first rewinds its KV cache to ``VerifyFrame.keep`` positions."""

VERDICT = "verdict"
"""Data kind: the last stage's greedy token after each of a verify trip's positions, back to the source."""

DRAFT_ASK = "draft_ask"
"""Data kind: the source to the draft's device (a stage other than the source): the committed tokens
the draft has not seen yet (``DraftAsk``)."""

PROPOSALS = "proposals"
"""Data kind: the draft's device back to the source: a trip's proposed tokens (and, when sampling,
the draft's distributions they were drawn from)."""


class SpeculativeOptions(Options, frozen=True, tag="speculative"):
    """``StartRun.options`` of a greedy speculative run: the source drafts ``k`` tokens with the
    checkpoint at ``draft_dir`` (read from the source's disk) and the stages verify them in one trip."""

    draft_dir: str
    k: int = 3
    keep_cache: bool = False
    """A diagnostic: the source ends the run with one more trip of the last token over the committed
    positions (each stage rewinds whatever the last trip's rejected proposals left), and every stage
    keeps its KV cache after the run for its coordinator's ``ReadStageCache``."""
    draft_device: str = ""
    """The plan's stage device that runs the draft ("": the source itself). Another stage drafts
    between trips, while the stages wait: the source sends it the newly committed tokens and it
    sends its proposals back (two hops a trip instead of none)."""
    every_stage: ClassVar[bool] = True
    """Every stage's ``StartRun`` carries them: each stage runs the verify trips."""

    def problem(self) -> str:
        if not 1 <= self.k <= MAX_SPECULATE:
            return f"k must be in [1, {MAX_SPECULATE}], got {self.k}"
        return "" if self.draft_dir else "no draft checkpoint named"


class VerifyFrame(Options, frozen=True, tag="verify_frame"):
    """What a ``VERIFY`` frame is about: the KV-cache length every stage keeps before it runs the
    frame's tokens (the prompt and the committed tokens but the last; 0 with the prompt itself)."""

    keep: int

    def problem(self) -> str:
        return "" if self.keep >= 0 else f"keep must be >= 0, got {self.keep}"


class DraftAsk(Options, frozen=True, tag="draft_ask"):
    """A ``DRAFT_ASK`` frame: the draft's context is its first ``keep`` tokens and the frame's; it
    proposes ``n`` tokens after them (drawn with the trip's generator, ``DataHeader.step``, when sampling)."""

    keep: int
    n: int

    def problem(self) -> str:
        return "" if self.keep >= 0 and 1 <= self.n <= MAX_SPECULATE else f"keep >= 0, n in [1, {MAX_SPECULATE}]"


class ReadStageCache(Message, frozen=True, tag="read_stage_cache"):
    """Asks a stage for the KV cache its last ``keep_cache`` speculative run left (answered only to
    the coordinator whose stage it is): how an exactness test over agent processes sees each stage."""


class StageCache(Message, frozen=True, tag="stage_cache"):
    """A stage's kept KV cache: ``length`` positions; per decoder block ``layers[i]`` (the model's
    own layer index), its keys and values, each ``shape`` [B, KV heads, length, head dim] of
    ``dtype`` (a torch dtype's name), raw little-endian bytes."""

    length: int
    layers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    keys: tuple[bytes, ...]
    values: tuple[bytes, ...]

    def problem(self) -> str:
        if not len(self.layers) == len(self.keys) == len(self.values):
            return "layers, keys and values must have one entry per layer"
        return "" if len(self.shape) == 4 and self.shape[2] == self.length else "shape must be [B, heads, length, dim]"


class TimeDraft(Message, frozen=True, tag="time_draft"):
    """Time the draft at ``draft_dir`` (this agent's disk) proposing as a run's source does: ``trips``
    proposals of ``k`` tokens over a context of ``context`` tokens that grows by what a trip commits,
    at this device's emulated speed. What the cost model's draft token is (``Profile.draft_times``)."""

    draft_dir: str
    k: int = 4
    trips: int = 12
    context: int = 8
    threads: int = 0

    def problem(self) -> str:
        if not (1 <= self.k <= MAX_SPECULATE and 1 <= self.trips <= 256 and 1 <= self.context <= 4096):
            return f"k in [1, {MAX_SPECULATE}], trips in [1, 256], context in [1, 4096]"
        return "" if self.draft_dir and 0 <= self.threads <= 1024 else "a draft directory and threads >= 0"


class DraftTimed(Message, frozen=True, tag="draft_timed"):
    """``TimeDraft``'s answer: the median time of one proposed token over the trips, and each trip's."""

    token_s: float
    per_trip_s: tuple[float, ...]
