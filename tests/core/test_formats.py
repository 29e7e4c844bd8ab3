import json
import os
import stat
from pathlib import Path

import msgspec
import pytest

from core.errors import FormatError
from core.formats import decode, format_of, json_schema, load, save
from core.planning.schemas import SCHEMA_BEGIN, SCHEMA_END, schemas_markdown
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.devices.profile import Profile
from core.planning.scenarios import Scenario, legacy_paper_scenario, paper_scenario, random_problem
from core.planning.solvers import solve_min_latency

REPO = Path(__file__).resolve().parents[2]


def test_problem_and_plan_survive_a_save_and_load(tmp_path):
    problem = random_problem(3, 3, 6)
    plan = solve_min_latency(problem).plan
    save(tmp_path / "p.json", problem)
    save(tmp_path / "plan.json", plan)
    assert load(tmp_path / "p.json", PlanningProblem) == problem
    assert load(tmp_path / "plan.json", ShardPlan) == plan
    assert format_of(tmp_path / "plan.json") == "edgeshard.plan"


def test_saved_files_are_ordinary_readable_documents(tmp_path):
    save(tmp_path / "plan.json", solve_min_latency(random_problem(3, 3, 6)).plan)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "plan.json").st_mode) == 0o666 & ~umask  # not mkstemp's 0600


def test_a_wrong_field_names_the_file_the_json_path_and_the_problem(tmp_path):
    doc = json.loads(msgspec.json.encode(random_problem(3, 3, 6)))
    doc["profile"]["cluster"]["devices"][1]["memory_bytes"] = "lots"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError) as info:
        load(path, PlanningProblem)
    err = info.value
    assert err.source == str(path)
    assert err.field == "$.profile.cluster.devices[1].memory_bytes"
    assert "int" in err.problem


def test_an_unknown_field_is_rejected(tmp_path):
    doc = json.loads(msgspec.json.encode(random_problem(3, 3, 6)))
    doc["workload"]["promt_tokens"] = 5
    with pytest.raises(FormatError, match="promt_tokens"):
        decode(json.dumps(doc), PlanningProblem, "x.json")


def test_a_file_of_another_format_says_what_it_is():
    plan = solve_min_latency(random_problem(3, 3, 6)).plan
    with pytest.raises(FormatError, match="'edgeshard.plan' file, expected format 'edgeshard.problem'"):
        decode(msgspec.json.encode(plan), PlanningProblem, "plan.json")


def test_a_newer_version_is_refused_with_advice():
    doc = json.loads(msgspec.json.encode(random_problem(3, 3, 6)))
    doc["version"] = 99
    with pytest.raises(FormatError, match="upgrade"):
        decode(json.dumps(doc), PlanningProblem)


def test_a_version_1_profile_loads_migrated_with_how_it_was_timed_not_recorded():
    from core.devices.profile import PROFILE_VERSION, Profile

    doc = json.loads(msgspec.json.encode(random_problem(3, 3, 6).profile))
    doc["version"] = 1
    for t in doc["times"]:
        del t["cache_timing"], t["warm_reason"]
    profile = decode(json.dumps(doc), Profile)
    assert profile.version == PROFILE_VERSION == 7
    assert {(t.cache_timing, t.warm_reason) for t in profile.times} == {("", "")}


def test_not_json_is_a_format_error():
    with pytest.raises(FormatError, match="not valid JSON"):
        decode(b"{", Profile, "p.json")


def test_scenario_is_a_registered_versioned_format(tmp_path):
    scen = Scenario(name="one", problems=(random_problem(1, 3, 5),))
    save(tmp_path / "s.json", scen)
    assert format_of(tmp_path / "s.json") == "edgeshard.scenario"
    assert load(tmp_path / "s.json", Scenario) == scen


def test_schemas_are_generated_from_the_types():
    schema = json_schema(ShardPlan)
    props = schema["$defs"]["ShardPlan"]["properties"]
    assert {"stages", "micro_batch_size", "micro_batches", "format", "version"} <= set(props)


def test_docs_embed_the_current_schemas():
    text = (REPO / "docs" / "formats.md").read_text()
    block = text.split(SCHEMA_BEGIN)[1].split(SCHEMA_END)[0]
    assert block.strip() == schemas_markdown().strip(), "run: python -m core.planning.schemas docs/formats.md"


def test_the_shipped_paper_scenario_is_what_the_code_derives():
    shipped = load(REPO / "resources" / "scenarios" / "edgeshard-paper.json", Scenario)
    assert shipped == paper_scenario(), "run: python -m core.planning.scenarios"
    legacy = load(REPO / "resources" / "scenarios" / "edgeshard-testbed-fp16.json", Scenario)
    assert legacy == legacy_paper_scenario(), "run: python -m core.planning.scenarios"


def test_problem_errors_lists_every_inconsistency_beyond_the_types():
    from core.devices.cluster import Link
    from core.planning.problem import Workload, problem_errors

    problem = random_problem(3, 3, 6)
    cluster = msgspec.structs.replace(problem.profile.cluster, links=problem.profile.cluster.links + (
        Link(src="d0", dst="nowhere", bandwidth_mbit_s=0.0),))
    bad = msgspec.structs.replace(
        problem, profile=msgspec.structs.replace(problem.profile, cluster=cluster), memory_headroom=1.5,
        workload=Workload(prompt_tokens=0, generated_tokens=1, batch_size=2, micro_batch_size=3))
    text = "\n".join(problem_errors(bad))
    for needle in ("links[", "unknown device 'nowhere'", "bandwidth_mbit_s: must be positive", "prompt_tokens",
                   "micro_batch_size", "memory_headroom"):
        assert needle in text
    assert problem_errors(problem) == []
