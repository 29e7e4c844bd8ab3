"""The offline steps as commands on a real (generated) Mixtral checkpoint: profile-activations,
profile-storage, adapt-bits; their files feed the planner (scenario --activations/--storage/--bits);
bad input is refused with one line naming it."""

from __future__ import annotations

import json
import shutil

import pytest

from agents.techniques.expert_offload.offload import ExpertOffloadExecutor
from core import formats
from core.models.checkpoints import ModelRecipe, make_model
from core.reporting import RecordingReporter
from core.techniques.expert_offload.problem import OffloadProblem
from core.techniques.expert_offload.profiling import storage_bandwidth
from tests.core.cli.test_cli_run import run_cli

CALIBRATION = ["the cat sat on the mat", "a river runs through the valley", "hello there my friend",
               "the quick brown fox jumps"]
HELD_OUT = ["over the lazy dog", "the river and the cat"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-profiling")
    model = make_model(ModelRecipe(family="mixtral", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=11,
                                   experts=4), folder / "tiny-mixtral")
    (folder / "calibration.txt").write_text("\n".join(CALIBRATION) + "\n")
    (folder / "held-out.txt").write_text("\n\n".join(HELD_OUT) + "\n")
    return folder, model


def test_profile_activations_saves_the_transitions_agents_read_and_reports_recall(moe):
    folder, model = moe
    code, out = run_cli(["moe", "profile-activations", model, "--texts", folder / "calibration.txt",
                         "--held-out", folder / "held-out.txt"])
    assert code == 0 and "top-2 recall on 2 held-out texts" in out
    summary = json.loads((model / "expert-activations.json").read_text())
    assert 0.0 <= summary["recall"] <= 1.0 and summary["calibration_texts"] == 4
    assert sum(map(sum, summary["activations"])) == 2 * 2 * (summary["calibration_tokens"] - 4)  # blocks x k x steps
    executor = ExpertOffloadExecutor(str(model), 0, 4, slots=2)
    try:
        assert float(executor.predictor.transitions.sum()) > 0  # the agent starts from the profile
    finally:
        executor.close()


def test_profile_storage_measures_the_bandwidth_of_reading_every_expert(moe, tmp_path):
    _, model = moe
    reporter = RecordingReporter()
    out = storage_bandwidth(model, repeats=2, reporter=reporter)
    assert out["reads"] == 2 * 2 * 4 and out["bytes"] > 0 and out["bandwidth_bps"] > 0
    assert reporter.progresses[-1] == (24, 24)  # two cold passes, one warm
    for kind in ("cold", "warm"):  # each read splits into its fixed cost and its bytes at the bandwidth
        part = out[kind]
        assert part["fixed_s"] >= 0 and part["read_s"] == pytest.approx(
            part["fixed_s"] + out["expert_bytes"] / part["bandwidth_bps"], rel=1e-9)
    assert out["expert_bytes"] * 2 * 2 * 4 == out["bytes"]
    code, printed = run_cli(["moe", "profile-storage", model, "--out", tmp_path / "s.json"])
    assert code == 0 and "MB/s" in printed
    assert json.loads((tmp_path / "s.json").read_text())["format"] == "edgeshard.storage-profile"


def test_adapt_bits_writes_the_adapted_experts_and_the_measured_bit_options(moe, tmp_path):
    folder, source = moe
    model = tmp_path / "tiny-mixtral"
    shutil.copytree(source, model)
    code, out = run_cli(["moe", "adapt-bits", model, "--texts", folder / "held-out.txt", "--bound", "0.5"])
    assert code == 0, out
    result = json.loads((model / "expert-bits.json").read_text())
    assert result["perplexity_fp32"] > 1 and result["evaluations"] >= 1 + 3  # fp32 + uniform INT8/4/2
    names = [o["name"] for o in result["options"]]
    assert names[:4] == ["fp32", "int8", "int4", "int2"] and names[4].startswith("adapted")
    bits = json.loads((model / "expert-offload.json").read_text())["expert_bits"]
    lower, upper = result["lower_bits"], result["upper_bits"]
    assert len(bits) == 8 and set(bits.values()) <= {lower, upper}
    assert sum(1 for b in bits.values() if b == lower) == result["low_experts"]
    assert result["options"][4]["accuracy_loss"] <= 0.5
    assert (model / "experts-quantized.safetensors").is_file()


def test_the_planner_reads_the_measured_files(moe, tmp_path):
    folder, model = moe
    storage = tmp_path / "storage.json"
    storage.write_text(json.dumps({"format": "edgeshard.storage-profile", "version": 1, "bandwidth_bps": 123e6}))
    bits = tmp_path / "bits.json"
    bits.write_text(json.dumps({"format": "edgeshard.expert-bits", "version": 1, "options": [
        {"name": "fp32", "avg_bits": 32.0, "accuracy_loss": 0.0},
        {"name": "int2x3+int4", "avg_bits": 3.25, "accuracy_loss": 0.02}]}))
    activations = tmp_path / "act.json"
    activations.write_text(json.dumps({"format": "edgeshard.expert-activations", "version": 1, "recall": 0.71}))
    code, out = run_cli(["moe", "scenario", "--out", tmp_path / "p.json", "--storage", storage, "--bits", bits,
                         "--activations", activations])
    assert code == 0, out
    problem = formats.load(tmp_path / "p.json", OffloadProblem)
    assert (problem.bandwidth_bps, problem.predictor_recall) == (123e6, 0.71)
    assert [b.name for b in problem.bit_options] == ["fp32", "int2x3+int4"]


@pytest.mark.parametrize("flag, content, words", [
    ("--storage", '{"format": "edgeshard.storage-profile", "bandwidth_bps": -1}', "bandwidth_bps must be > 0"),
    ("--storage", '{"format": "edgeshard.storage-profile", "warm": {"bandwidth_bps": 1e8, "fixed_s": -0.5}}',
     "fixed_s must be >= 0 (got -0.5)"),
    ("--storage", "not json", "cannot read it as JSON"),
    ("--activations", '{"format": "edgeshard.storage-profile", "recall": 0.5}', "not an edgeshard.expert-activations"),
    ("--activations", '{"format": "edgeshard.expert-activations", "recall": 1.5}', "recall must be a number"),
    ("--bits", '{"format": "edgeshard.expert-bits", "options": [{"name": "x", "avg_bits": 40, "accuracy_loss": 0}]}',
     "avg_bits"),
    ("--bits", '{"format": "edgeshard.expert-bits", "options": "many"}', "bad bit options"),
])
def test_bad_profile_files_are_refused_naming_them(tmp_path, capsys, flag, content, words):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code, _ = run_cli(["moe", "scenario", "--out", tmp_path / "p.json", flag, bad])
    assert code == 2 and words in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_bad_inputs_of_the_profiling_commands_are_refused(moe, tmp_path, capsys):
    folder, model = moe
    dense = make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1),
                       tmp_path / "dense")
    (tmp_path / "empty.txt").write_text("\n\n")
    cases = [
        (["moe", "profile-activations", model, "--texts", tmp_path / "missing.txt", "--held-out", folder / "held-out.txt"],
         "cannot read the text file"),
        (["moe", "profile-activations", model, "--texts", tmp_path / "empty.txt", "--held-out", folder / "held-out.txt"],
         "0 usable texts"),
        (["moe", "profile-storage", dense], "needs a Mixtral"),
        (["moe", "profile-storage", tmp_path / "nowhere"], "nowhere"),
        (["moe", "adapt-bits", model, "--texts", folder / "held-out.txt", "--bound", "0"], "--bound"),
        (["moe", "profile-storage", model, "--repeats", "0"], "--repeats"),
    ]
    for argv, words in cases:
        try:
            code, _ = run_cli(argv)
        except SystemExit as exit_:  # argparse refuses an out-of-range argument
            code = exit_.code
        err = capsys.readouterr().err
        assert code != 0 and words in err and "Traceback" not in err, (argv, err)


@pytest.fixture(scope="module")
def device_profile(moe, tmp_path_factory):
    """A real profile (the agent's profiler on this machine) of the tiny Mixtral, as `edgeshard profile` builds it."""
    from agents.profiler import profile_units
    from agents.protocol import ComputeOptions
    from core.devices.profiling import build_profile

    _, model = moe
    config = json.loads((model / "config.json").read_text())
    compute = profile_units(ComputeOptions(config=config, prompt_tokens=8, batch_sizes=(1,), repeats=3, warmup=1),
                            device="edge-0")
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    formats.save(path, build_profile(config, {"edge-0": compute}, [], dtype="fp32", model_name="tiny-mixtral",
                                     prompt_tokens=8))
    return path, compute


def test_the_planner_takes_the_models_sizes_and_the_devices_profiled_compute_times(moe, device_profile, tmp_path):
    from agents.shard import StageExecutor

    _, model = moe
    path, compute = device_profile
    storage = tmp_path / "storage.json"
    storage.write_text(json.dumps({"format": "edgeshard.storage-profile", "version": 1, "bandwidth_bps": 55e6}))
    code, out = run_cli(["moe", "scenario", "--profile", path, "--device", "edge-0", "--model", model,
                         "--storage", storage, "--budget-fraction", "0.5", "--out", tmp_path / "p.json"])
    assert code == 0, out
    problem = formats.load(tmp_path / "p.json", OffloadProblem)
    m, blocks = problem.model, compute.units[1:3]
    assert (m.layers, m.experts, m.top_k, problem.bandwidth_bps) == (2, 4, 2, 55e6)
    assert m.expert_compute_s == pytest.approx(sum(u.expert_decode_s for u in blocks) / 2)
    assert m.layer_compute_s == pytest.approx(sum(max(0.0, u.decode_s[0] - 2 * u.expert_decode_s) for u in blocks) / 2)
    whole = StageExecutor(str(model), 0, 4).memory_bytes()  # fp32: every weight resident
    assert m.resident_bytes + 2 * 4 * m.expert_bytes == whole
    assert problem.memory_budget_bytes == int(0.5 * whole)
    code, out = run_cli(["moe", "compare", tmp_path / "p.json"])
    assert code == 0 and "edgemoe" in out


@pytest.mark.parametrize("args, words", [
    (["--device", "phone"], "has no compute times of device 'phone'"),
    (["--device", "edge-0"], "go together"),
])
def test_a_profile_scenario_with_a_missing_part_or_device_is_refused(moe, device_profile, tmp_path, capsys, args,
                                                                     words):
    _, model = moe
    path, _ = device_profile
    extra = ["--model", model] if "phone" in args else []
    code, _ = run_cli(["moe", "scenario", "--profile", path, *args, *extra, "--out", tmp_path / "p.json"])
    assert code == 2 and words in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_a_profile_without_expert_times_is_refused_saying_to_profile_again(moe, device_profile, tmp_path, capsys):
    import msgspec

    from core.devices.profile import Profile

    _, model = moe
    path, _ = device_profile
    old = formats.load(path, Profile)
    formats.save(tmp_path / "old.json", msgspec.structs.replace(
        old, times=tuple(msgspec.structs.replace(t, expert_decode_s=()) for t in old.times)))
    code, _ = run_cli(["moe", "scenario", "--profile", tmp_path / "old.json", "--device", "edge-0", "--model", model,
                       "--out", tmp_path / "p.json"])
    assert code == 2 and "profile the model again" in capsys.readouterr().err
