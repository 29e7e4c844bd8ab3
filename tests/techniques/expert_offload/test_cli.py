"""``edgeshard moe``: scenario → compare → plan → configure, the file an agent then reads."""

from __future__ import annotations

import json

from core.cli import main
from tests.agents.conftest import tiny_model_dirs  # noqa: F401  (fixture)


def test_scenario_compare_plan_and_configure_write_the_options_an_agent_reads(tmp_path, capsys, tiny_model_dirs):
    import shutil

    problem, plan = tmp_path / "p.json", tmp_path / "plan.json"
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["mixtral"], model_dir)
    assert main(["moe", "scenario", "--budget-fraction", "0.1", "--out", str(problem)]) == 0
    assert main(["moe", "compare", str(problem)]) == 0
    table = capsys.readouterr().out
    assert "edgemoe" in table and "optimal" in table and "failed: STI streams whole layers" in table
    assert main(["moe", "plan", str(problem), "--strategy", "io-exp", "--out", str(plan)]) == 0
    assert main(["moe", "configure", str(plan), str(model_dir), "--bandwidth-mbps", "300"]) == 0
    options = json.loads((model_dir / "expert-offload.json").read_text())
    assert options["slots"] == 1 and options["policy"] == "lru" and options["bandwidth_bps"] == 300e6

    from agents.techniques.expert_offload.offload import ExpertOffloadExecutor

    executor = ExpertOffloadExecutor(str(model_dir), 0, 6)
    executor.close()
    assert (executor.slots, executor.policy, executor.store.bandwidth_bps) == (1, "lru", 300e6)


def test_configuring_a_quantised_plan_without_its_expert_files_is_refused(tmp_path, capsys, tiny_model_dirs):
    problem, plan = tmp_path / "p.json", tmp_path / "plan.json"
    main(["moe", "scenario", "--budget-fraction", "0.1", "--out", str(problem)])
    main(["moe", "plan", str(problem), "--out", str(plan)])  # edgemoe: mixed INT2/4 at 10 %
    assert main(["moe", "configure", str(plan), tiny_model_dirs["mixtral"]]) == 2
    assert "quantised experts" in capsys.readouterr().err
