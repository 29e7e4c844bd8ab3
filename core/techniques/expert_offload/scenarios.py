"""A paper-shaped scenario (EdgeMoE's setting: a Mixtral-like model on a phone-class device
reading experts from flash). Its sizes and times are assumptions, not measurements."""

from __future__ import annotations

from core.techniques.expert_offload.problem import FULL_PRECISION, BitOption, MoeModel, OffloadProblem

ASSUMED_BIT_OPTIONS = (
    FULL_PRECISION,
    BitOption(name="int8", avg_bits=8.0, accuracy_loss=0.002),
    BitOption(name="int4", avg_bits=4.0, accuracy_loss=0.03),
    BitOption(name="mixed-2/4", avg_bits=3.0, accuracy_loss=0.045),
    BitOption(name="int2", avg_bits=2.0, accuracy_loss=0.30),
)
"""Illustrative only: measured ones come from ``edgeshard moe adapt-bits`` (``measured(bits=)``)."""


def paper_shaped(budget_fraction: float = 0.5, bandwidth_bps: float = 200e6) -> OffloadProblem:
    model = MoeModel(name="mixtral-like 8 experts, 8 blocks", layers=8, experts=8, top_k=2,
                     expert_bytes=3 * 1024 * 2816 * 4, resident_bytes=200_000_000,
                     layer_compute_s=0.004, expert_compute_s=0.003, head_s=0.01)
    full = model.resident_bytes + model.layers * model.experts * model.expert_bytes
    return OffloadProblem(model=model, device="phone", memory_budget_bytes=int(budget_fraction * full),
                          bandwidth_bps=bandwidth_bps, predictor_recall=0.6, bit_options=ASSUMED_BIT_OPTIONS)


def _json(path: str, expected: str) -> dict:
    import json

    from core.errors import FormatError

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as err:
        raise FormatError(path, f"cannot read it as JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != expected:
        raise FormatError(path, f"is not an {expected} file; make it with the matching edgeshard moe command")
    return data


def measured(problem: OffloadProblem, *, activations: str | None = None, storage: str | None = None,
             bits: str | None = None) -> OffloadProblem:
    """``problem`` with the offline profiles' measurements in place of its assumptions: the predictor's
    recall (profile-activations), the storage bandwidth (profile-storage), the bit options (adapt-bits).
    Each file is checked (format, values) and a bad one is a ``FormatError`` naming it."""
    import msgspec

    from core.errors import FormatError

    changes: dict = {}
    if activations:
        recall = _json(activations, "edgeshard.expert-activations").get("recall")
        if not isinstance(recall, (int, float)) or not 0 <= recall <= 1:
            raise FormatError(activations, f"recall must be a number in [0, 1] (got {recall!r}): profile again")
        changes["predictor_recall"] = float(recall)
    if storage:
        bandwidth = _json(storage, "edgeshard.storage-profile").get("bandwidth_bps")
        if not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise FormatError(storage, f"bandwidth_bps must be > 0 (got {bandwidth!r}): profile again")
        changes["bandwidth_bps"] = float(bandwidth)
    if bits:
        raw = _json(bits, "edgeshard.expert-bits").get("options")
        try:
            options = msgspec.convert(raw, tuple[BitOption, ...])
        except msgspec.ValidationError as err:
            raise FormatError(bits, f"bad bit options ({err}): adapt again") from None
        if not options:
            raise FormatError(bits, "has no bit options: adapt again")
        changes["bit_options"] = options
    fields = {f: getattr(problem, f) for f in problem.__struct_fields__}
    return OffloadProblem(**{**fields, **changes})  # checked again (__post_init__), e.g. bits in [1, 32]
