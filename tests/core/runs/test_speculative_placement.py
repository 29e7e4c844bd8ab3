"""Where the draft runs, at the entrance (``core.runs.speculative``, no agents): ``--draft-device``
names one of the plan's stage devices, and ``--speculate auto`` without it puts the draft where the
cost model predicts the most tokens/s counting the two hops (the run itself over agent processes:
tests/core/runs/test_speculative.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from core.devices.profile import DraftTime
from core.models.draft_distillation import SPECULATION_FILE
from core.runs.generation import GenerationSettings
from core.runs.speculative import DraftMismatch, auto_settings, speculative_entrance
from tests.core.planning.test_speculation import PLAN, _problem


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A target and a draft as the entrance reads them: their configs (no tokenizer files: the same
    none) and the draft's stored acceptance rate; no weights (no agent loads them here)."""
    root = tmp_path_factory.mktemp("placement")
    for name, layers in (("target", 2), ("draft", 1)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"vocab_size": 512, "num_hidden_layers": layers}))
    (root / "draft" / SPECULATION_FILE).write_text(json.dumps({"acceptance_rate": 0.8}))
    return str(root / "target"), str(root / "draft")


def _timed(latency_ms: float):
    """The toy problem with the draft timed 5 ms a token on the source a, 1 ms on b."""
    problem = _problem(latency_ms)
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, draft_times=(
        DraftTime(device="a", draft="draft", token_s=5e-3), DraftTime(device="b", draft="draft", token_s=1e-3))))


def test_auto_drafts_on_the_faster_device_when_its_hops_are_cheap_and_on_the_source_when_they_are_not(checkpoints):
    target, draft = checkpoints
    assert auto_settings(_timed(0.1), PLAN, target, draft).draft_device == "b"
    assert auto_settings(_timed(50.0), PLAN, target, draft).draft_device == ""
    # named: only k is chosen there (plain decoding when the draft is too slow there)
    assert auto_settings(_timed(50.0), PLAN, target, draft, "b").draft_device == "b"
    assert auto_settings(_timed(0.1), PLAN, target, draft, "a") is None


def test_a_named_draft_device_is_kept_and_one_outside_the_plan_is_refused_in_one_line(checkpoints):
    target, draft = checkpoints
    settings = speculative_entrance(target, draft, 2, ["one"], GenerationSettings(), PLAN, draft_device="b")
    assert (settings.k, settings.draft_device) == (2, "b")
    with pytest.raises(DraftMismatch, match=r"--draft-device 'c' is not a device of the plan \(a, b\)"):
        speculative_entrance(target, draft, 2, ["one"], GenerationSettings(), PLAN, draft_device="c")
