"""``edgeshard compare --draft DIR``: plain vs speculative decoding per plan, from the cost model and
the draft's stored acceptance rate; a draft without one is refused before any solve."""

from __future__ import annotations

import argparse
import json
import re

import msgspec

from core.cli import main
from core.cli.planning import load_problems
from core.planning.cost import evaluate
from core.planning.plan import ShardPlan
from core.models.demo_models import shipped

SCENARIO = "resources/scenarios/edgeshard-testbed-fp16.json"


def test_compare_with_a_draft_shows_each_plans_plain_and_speculative_tokens_per_second(capsys):
    assert main(["compare", SCENARIO, "--problem", "llama-2-7b", "--objective", "latency",
                 "--draft", str(shipped("llama-draft"))]) == 0
    text = capsys.readouterr().out
    assert "plain -> speculative" in text
    plain = float(re.search(r"^\s+edgeshard: ([\d.]+) -> ", text, re.M).group(1))
    # the reference: the cost model's latency of the same plan serving one sequence (m = 1, K = 1)
    assert main(["plan", SCENARIO, "--problem", "llama-2-7b", "--objective", "latency", "--json"]) == 0
    plan = msgspec.convert(json.loads(capsys.readouterr().out)["plan"], ShardPlan)
    problem = load_problems(argparse.Namespace(file=SCENARIO, problem="llama-2-7b", source=None, prompt_tokens=None,
                                               generated_tokens=None, batch=None))[0]
    one = evaluate(problem, msgspec.structs.replace(plan, micro_batch_size=1, micro_batches=1))
    assert abs(plain - 1 / one.latency_per_token_s) <= 0.051
    assert re.search(r"^\s+edgeshard: [\d.]+ -> ([\d.]+ \(k \d, [\d.]+x\)|plain decoding is faster)", text, re.M)


def test_compare_with_a_draft_of_no_stored_acceptance_rate_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["compare", SCENARIO, "--draft", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no measured acceptance rate" in err[0]
