"""Spatial's memory model against the network an agent really generates."""

from agents.techniques.spatial.network import build_network
from core.techniques.spatial.cost import evaluate
from core.techniques.spatial.strategies import run_strategy
from tests.techniques.spatial.conftest import make_problem


def test_every_devices_need_holds_the_whole_generated_network_and_its_largest_strip():
    problem = make_problem()
    plan = run_strategy(problem, "even").plan
    net = build_network(problem.model.spec(), seed=0)
    held = sum(t.nbytes for group in net.params for pair in group for t in pair) \
        + sum(w.nbytes + b.nbytes for w, b in net.head_params)
    need = evaluate(problem, plan).memory_need
    worker = plan.devices[-1]
    # beside the weights, a worker holds its largest strip in and out: less than one whole layer's maps
    largest_maps = max(layer.in_bytes() + layer.out_bytes() for layer in problem.model.spec().layers)
    assert held < need[worker] <= held + largest_maps
    assert need[problem.gateway] == held + largest_maps
