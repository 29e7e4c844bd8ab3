"""bench.sample_split: a calibrated prediction scored apart on the configurations it was fitted on and on
the ones it never saw."""

from bench.sample_split import in_and_out_of_sample


def test_fitted_configurations_are_scored_only_in_sample_and_the_others_only_out_of_sample():
    ratios = {"even/2": 1.02, "even/4": 0.9, "cbps/4": 1.3, "fused/4": 1.1, "cbps/3": 0.8}
    split = in_and_out_of_sample(ratios, {"even/2", "even/4", "never-run"})
    assert split["in_sample"] == {"within": 2, "of": 2, "median_abs_error": 0.1, "configurations": ["even/2", "even/4"]}
    assert split["out_of_sample"]["configurations"] == ["cbps/4", "fused/4", "cbps/3"]
    assert (split["out_of_sample"]["within"], split["out_of_sample"]["of"]) == (1, 3)
    assert split["out_of_sample"]["median_abs_error"] == 0.2  # errors 0.3, 0.1, 0.2: the median


def test_a_side_with_no_configuration_has_no_error():
    assert in_and_out_of_sample({"a": 1.0}, ["a"])["out_of_sample"] == {
        "within": 0, "of": 0, "median_abs_error": None, "configurations": []}
