"""In sample and out of sample, side by side: how a calibrated prediction scores on the configurations
it was fitted on and on the ones it never saw (issue 30: "measured means measured"). The benches that
calibrate (spatial partitioning, EPD) report both with this one function."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def in_and_out_of_sample(ratios: Mapping[str, float], fitted: Iterable[str], tolerance: float = 0.15) -> dict:
    """``ratios``: configuration → predicted / measured; ``fitted``: the configurations the calibration was
    fitted on. Per side: how many ratios are within ``tolerance`` of 1, of how many, the median absolute
    error (the upper median) and the configurations."""
    fitted = set(fitted)
    out = {}
    for sample, keys in (("in_sample", [k for k in ratios if k in fitted]),
                         ("out_of_sample", [k for k in ratios if k not in fitted])):
        errs = sorted(abs(ratios[k] - 1) for k in keys)
        out[sample] = {"within": sum(e <= tolerance for e in errs), "of": len(errs),
                       "median_abs_error": round(errs[len(errs) // 2], 3) if errs else None, "configurations": keys}
    return out
