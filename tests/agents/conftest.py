"""Tiny real checkpoints of every supported family, generated once per test session."""

from __future__ import annotations

import pytest

from core.models.checkpoints import FAMILIES, ModelRecipe, make_model

TINY_LAYERS = 4
"""4 blocks → 6 units, enough for 4 uneven stages."""


def tiny_recipe(family: str, **overrides) -> ModelRecipe:
    values = dict(family=family, layers=TINY_LAYERS, hidden=64, heads=4, vocab=512, seed=7)
    if family != "gpt2":
        values["kv_heads"] = 2
    values.update(overrides)
    return ModelRecipe(**values)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """family → directory of a 4-block, hidden-64 generated checkpoint (real tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: str(make_model(tiny_recipe(family), root / family)) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


class ComputeClock:
    """``agents.emulation``'s clocks, moved only by the test: ``run(wall_s, cpu_s)`` is a computation
    that took that wall time and that much of its thread's CPU; ``sleep`` (the emulated pause) is
    recorded in ``slept`` and passes wall time only."""

    def __init__(self) -> None:
        self.wall, self.cpu = 0.0, 0.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.wall += s

    def run(self, wall_s: float, cpu_s: float) -> None:
        self.wall += wall_s
        self.cpu += cpu_s


@pytest.fixture
def compute_clock(monkeypatch) -> ComputeClock:
    """The emulated slowdown's clocks (every kind of work's, ``agents.emulation.end_emulated``) under the test's control."""
    import agents.emulation

    clock = ComputeClock()
    monkeypatch.setattr(agents.emulation, "time", clock)
    return clock
