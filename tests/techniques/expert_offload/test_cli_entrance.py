"""`edgeshard moe` refuses bad input where it is read, before any work: a plan whose expert buffer
has no slot (before: ``slots`` of -3 or 0 was written beside the checkpoint and exit 0, refused
only when an agent loaded it), and profiling a model that is not a Mixtral (before: 15-20 s of
loading a tokenizer and the model first), or to an output path that is a folder."""

from __future__ import annotations

import json

import pytest

from core.cli import main
from core.techniques.expert_offload.problem import OffloadPlan
from tests.agents.conftest import tiny_model_dirs  # noqa: F401  (fixture)
from tests.entrances import refused


@pytest.mark.parametrize("slots", [-3, 0])
def test_configure_refuses_a_plan_without_a_buffer_slot_and_writes_nothing(slots, tmp_path, capsys, tiny_model_dirs):
    import shutil

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["mixtral"], model_dir)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "edgeshard.expert-offload-plan", "version": 1, "device": "phone",
                                "slots": slots, "policy": "lru"}))
    err = refused(["moe", "configure", plan, model_dir], capsys)
    assert "slots" in err and f"got {slots}" in err
    assert not (model_dir / "expert-offload.json").exists()


def test_a_plan_with_a_negative_preload_cannot_be_made():
    from core.errors import FormatError

    with pytest.raises(FormatError, match="preload"):
        OffloadPlan(device="phone", slots=4, preload=-1)


@pytest.mark.parametrize("verb", ["profile-activations", "adapt-bits", "profile-storage"])
def test_profiling_a_model_that_is_not_a_mixtral_is_refused_from_its_config(verb, tmp_path, capsys, monkeypatch,
                                                                            tiny_model_dirs):
    import core.models.checkpoints
    import core.runs.generation

    def loaded(*_a, **_k):
        pytest.fail("a tokenizer or the checkpoint was loaded before the model's family was checked")

    monkeypatch.setattr(core.runs.generation, "load_tokenizer", loaded)
    monkeypatch.setattr(core.models.checkpoints, "check_model_dir", loaded)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\na river runs\n")
    extra = {"profile-activations": ["--texts", texts, "--held-out", texts], "adapt-bits": ["--texts", texts],
             "profile-storage": []}[verb]
    err = refused(["moe", verb, tiny_model_dirs["llama"], *extra], capsys)
    assert "is a llama model: expert offloading needs a Mixtral" in err


def test_profile_storage_refuses_an_output_folder_before_measuring(tmp_path, capsys, tiny_model_dirs):
    err = refused(["moe", "profile-storage", tiny_model_dirs["mixtral"], "--out", tmp_path], capsys)
    assert "--out" in err and "is a folder" in err
