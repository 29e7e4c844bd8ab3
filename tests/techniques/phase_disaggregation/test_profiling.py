"""The least-squares fit behind profiled phase costs."""

from __future__ import annotations

import pytest

from core.techniques.phase_disaggregation.profiling import fit_line
from core.techniques.phase_disaggregation.types import EpdInputError


def test_a_line_through_exact_points_is_recovered():
    slope, intercept = fit_line([(1, 0.5 + 0.25), (2, 0.5 + 0.5), (4, 0.5 + 1.0)])
    assert slope == pytest.approx(0.25) and intercept == pytest.approx(0.5)


def test_a_negative_intercept_from_noise_is_clamped_and_the_slope_refitted_through_the_origin():
    slope, intercept = fit_line([(1, 0.1), (2, 0.5), (3, 0.9)])
    assert intercept == 0.0 and slope > 0
    assert slope == pytest.approx((0.1 + 1.0 + 2.7) / (1 + 4 + 9))


def test_probes_of_one_size_cannot_be_fitted():
    with pytest.raises(EpdInputError, match="two or more sizes"):
        fit_line([(2, 0.1), (2, 0.2)])
