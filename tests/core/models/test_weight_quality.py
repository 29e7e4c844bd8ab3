"""Perplexity per weight precision, measured once and stored with the profile: checked against the
same model quantized in one process by torchao itself and scored by transformers' own loss; then
``edgeshard plan --quality-bound`` plans with it."""

import json
import math

import msgspec
import pytest
import torch
import transformers
from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from core.cli import main as cli_main
from core.formats import load, save
from core.devices.profile import Profile
from core.models.checkpoints import ModelRecipe, make_model
from core.models.units import load_model_spec
from core.planning.scenarios import DeviceSpec, synthetic_problem
from tests.entrances import refused

TEXTS = ["the cat sat on the mat and looked at the river", "a wise man once said nothing at all", "hello there"]
REFERENCE = {"int8": lambda: Int8WeightOnlyConfig(),
             "int4": lambda: PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A tiny llama, a synthetic profile of it, and the CLI's measurement stored into that profile."""
    folder = tmp_path_factory.mktemp("quality")
    model_dir = str(make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                                           seed=3), folder / "tiny-llama"))
    problem = synthetic_problem([DeviceSpec(id="a", tflops=1, memory_bandwidth_gb_s=10, memory_gib=1),
                                 DeviceSpec(id="b", tflops=1, memory_bandwidth_gb_s=10, memory_gib=1)],
                                load_model_spec(model_dir, "fp32"), dtype="fp32")
    save(folder / "profile.json", problem.profile)
    (folder / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    code = cli_main(["measure-precision", model_dir, "--profile", str(folder / "profile.json"),
                     "--texts", str(folder / "texts.txt"), "--out", str(folder / "measured.json"),
                     "--timing-steps", "2", "--rounds", "1"])
    assert code == 0
    return model_dir, folder, load(folder / "measured.json", Profile)


def _hf_perplexity(model_dir: str, weights: str) -> float:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if weights != "fp":
        quantize_(model.model.layers, REFERENCE[weights]())
    nll, count = 0.0, 0
    with torch.inference_mode():
        for text in TEXTS:
            ids = tok(text, return_tensors="pt")["input_ids"]
            nll += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("weights", ["fp", "int8", "int4"])
def test_the_stored_perplexity_is_the_library_quantized_models_own(measured, weights):
    model_dir, _, profile = measured
    stored = {q.weights: q for q in profile.weight_quality}
    assert stored[weights].perplexity == pytest.approx(_hf_perplexity(model_dir, weights), rel=1e-4)
    assert stored[weights].decode_time_ratio > 0 and stored[weights].text.endswith("3 texts")


def test_plan_with_a_quality_bound_names_each_stages_weights(measured, capsys):
    _, folder, profile = measured
    rise = {q.weights: q.perplexity for q in profile.weight_quality}
    loose = max(rise.values()) / rise["fp"] - 1 + 0.01
    assert cli_main(["plan", str(folder / "measured.json"), "--quality-bound", f"{loose:.4f}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "optimal" and {s["weights"] for s in doc["plan"]["stages"]} <= {"fp", "int8", "int4"}
    assert cli_main(["compare", str(folder / "measured.json"), "--quality-bound", f"{loose:.4f}",
                     "--objective", "latency"]) == 0
    out = capsys.readouterr().out
    assert "edgeshard-fp" in out and "quality bound: perplexity at most" in out


def test_a_quality_bound_on_an_unmeasured_profile_is_refused_in_one_line(measured, capsys):
    _, folder, _ = measured
    err = refused(["plan", str(folder / "profile.json"), "--quality-bound", "0.05"], capsys)
    assert "no perplexity per weight precision" in err and "measure-precision" in err
