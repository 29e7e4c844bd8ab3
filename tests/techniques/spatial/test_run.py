"""Real spatial runs on three local agents over CurveZMQ (strips on the data plane): every
partitioner's class scores equal the single-device forward; bad strips are refused by name
and the agents stay up."""

from __future__ import annotations

import json

import pytest
import torch
from msgspec import structs

from agents.protocol import AgentState, decode_control, encode_control, ProtocolError
from agents.techniques.spatial.messages import ComputeStrip, SpatialNet
from agents.techniques.spatial.network import build_network
from core.devices.agent_link import AgentLink
from core.devices.local_cluster import LocalCluster
from core.errors import RunFailed
from core.techniques.spatial.problem import CnnRef, SpatialInputError
from core.techniques.spatial.run import run_spatial
from core.techniques.spatial.strategies import ORDER, run_strategy
from tests.techniques.spatial.conftest import make_problem


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("spatial-run"), 3) as lc:
        with AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0, request_timeout_s=60.0) as link:
            link.wait_ready(timeout_s=30)
            yield link


def _local(network: str, mbps: float = 20.0):
    p = make_problem((4.0, 2.0, 1.0), mbps, network=network)
    return structs.replace(p, gateway="local-0", devices=tuple(
        structs.replace(d, id=f"local-{i}") for i, d in enumerate(p.devices)))


@pytest.mark.parametrize("network", ["vgg16", "resnet-style"])
def test_every_partitioners_real_run_equals_the_single_device_output(link, network):
    problem = _local(network)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    ref = build_network(problem.model.spec(), seed=0).forward(images)
    for name in ORDER:
        plan = run_strategy(problem, name).plan
        run = run_spatial(link, problem, plan, images)
        torch.testing.assert_close(torch.tensor(run.scores), ref, rtol=1e-4, atol=1e-4)
        assert run.figures.tokens == 2 and [t.token_ids[0] for t in run.tokens] == ref.argmax(-1).tolist()
        computes = [e for e in run.events if e.kind == "compute" and e.step == 0]
        assert len(computes) == sum(1 for ws in plan.widths for w in ws if w) + 1  # + the head
        assert all(e.end_s >= e.start_s >= 0 for e in run.events)


def test_a_strip_without_its_halo_is_refused_naming_the_columns_and_the_agent_answers_after(link):
    net = SpatialNet(network="vgg16", image=32, width_div=8, classes=10)
    x = torch.zeros(1, 3, 32, 16)
    bad = ComputeStrip(net=net, start=0, end=1, x_lo=0, lo=0, hi=16, shape=(1, 3, 32, 16),
                       data=x.numpy().tobytes())
    with pytest.raises(RunFailed, match=r"needs 3×32 columns \[0, 17\)"):
        link.request("local-1", bad)
    assert link.status_of(["local-1"])["local-1"].state in (AgentState.IDLE, AgentState.READY)


def test_a_strip_whose_bytes_do_not_match_its_shape_is_refused_at_decode():
    net = SpatialNet(network="vgg16", image=32)
    msg = ComputeStrip(net=net, start=0, end=1, x_lo=0, lo=0, hi=4, shape=(1, 3, 32, 5), data=b"\0" * 12)
    with pytest.raises(ProtocolError, match="data holds 12 bytes"):
        decode_control(encode_control(msg))


def test_an_image_larger_than_one_control_frame_is_refused_before_anything_is_sent(link):
    problem = structs.replace(_local("vgg16"), model=CnnRef(network="vgg16", image=512, width_div=8, classes=10))
    plan = run_strategy(problem, "even").plan
    with pytest.raises(SpatialInputError, match="does not fit one control frame"):
        run_spatial(link, problem, plan, torch.zeros(1, 3, 512, 512))
    assert {s.state for s in link.status().values()} <= {AgentState.IDLE, AgentState.READY}


def test_the_cli_runs_records_and_checks_a_plan_on_agents(tmp_path, capsys):
    from core.cli import main
    from core.formats import save
    from core.sessions.replay import Replay
    from core.sessions.store import SessionStore

    with LocalCluster(tmp_path / "cluster", 2) as lc:
        problem = structs.replace(_local("resnet-style"), devices=_local("resnet-style").devices[:2])
        save(tmp_path / "p.json", problem)
        rc = main(["spatial", "run", str(tmp_path / "p.json"), "--agents", str(lc.agents_file), "--images", "2",
                   "--strategy", "even", "--workspace", str(tmp_path / "ws.sqlite"), "--json",
                   "--events", str(tmp_path / "events.jsonl")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["max_abs_error"] < 1e-3 and len(out["images"]) == 2
    assert all(len(i["scores"]) == 10 and i["class"] == max(range(10), key=i["scores"].__getitem__)
               for i in out["images"])
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [w["value"]["token_ids"] for w in written if w["type"] == "tokens"] == [[i["class"]] for i in out["images"]]
    assert any(w["type"] == "timeline" and w["value"]["kind"] == "compute" for w in written)
    wire = out["wire"]  # strips scattered and gathered, as the agents' sockets sent them and as simulated
    assert wire["per_link"]["local-0->local-1"]["measured"] > 0 and wire["per_link"]["local-1->local-0"]["measured"] > 0
    assert 0.99 <= wire["measured_over_predicted"] <= 1.01  # the strips' tensors and each frame's header
    with SessionStore(tmp_path / "ws.sqlite") as store:
        runs = store.runs()
        assert [r.kind for r in runs] == ["measured", "predicted"]
        assert len(store.tokens(runs[0].id)) == 2 and runs[0].figures["wire"] == wire
        assert Replay.from_store(store, runs[0].id).duration_s > 0


def test_edgeshard_run_of_a_spatial_plan_classifies_png_and_jpeg_files_on_agents_and_records_them(tmp_path, capsys):
    from PIL import Image

    from core.cli import main
    from core.formats import save
    from core.models.multimodal import synthetic_images
    from core.sessions.store import SessionStore

    jpeg = tmp_path / "circles.jpg"
    Image.open(synthetic_images()[1]).convert("RGB").save(jpeg, quality=90)
    problem = make_problem((4.0, 2.0), 100.0, network="resnet-style")  # scenario devices: mapped onto the agents
    save(tmp_path / "p.json", problem)
    save(tmp_path / "plan.json", run_strategy(problem, "cbps").plan)
    with LocalCluster(tmp_path / "cluster", 2) as lc:
        rc = main(["run", "--plan", str(tmp_path / "plan.json"), "--problem", str(tmp_path / "p.json"),
                   "--agents", str(lc.agents_file), "--image", str(synthetic_images()[0]), "--image", str(jpeg),
                   "--workspace", str(tmp_path / "ws.sqlite"), "--events", str(tmp_path / "events.jsonl")])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("2 images on 2 agents (cbps") and "max |scores - one device| = " in out
    written = (tmp_path / "events.jsonl").read_text().splitlines()  # `run --events` of a spatial plan writes them
    assert sum(1 for line in written if '"type":"tokens"' in line) == 2 and len(written) > 2
    with SessionStore(tmp_path / "ws.sqlite") as store:
        measured = next(r for r in store.runs() if r.kind == "measured")
        assert len(store.tokens(measured.id)) == 2


def test_edgeshard_run_of_a_spatial_plan_refuses_a_bad_image_file_and_a_missing_problem(tmp_path, capsys):
    from core.cli import main
    from core.formats import save

    problem = make_problem((4.0, 2.0), 100.0)
    save(tmp_path / "p.json", problem)
    save(tmp_path / "plan.json", run_strategy(problem, "even").plan)
    (tmp_path / "x.png").write_bytes(b"\x89PNG broken")
    base = ["run", "--plan", str(tmp_path / "plan.json"), "--local", "--image", str(tmp_path / "x.png")]
    assert main(base + ["--problem", str(tmp_path / "p.json")]) == 2
    assert "x.png" in capsys.readouterr().err
    assert main(base) == 2
    assert "add --problem PROBLEM.json" in capsys.readouterr().err


def test_a_plan_on_scenario_devices_is_named_as_the_agents_gateway_first_and_too_few_agents_are_refused():
    from core.techniques.spatial.problem import check
    from core.techniques.spatial.run import on_agents

    problem = make_problem((4.0, 2.0, 1.0), 100.0)
    plan = run_strategy(problem, "even").plan
    p2, plan2 = on_agents(problem, plan, ["local-2", "local-0", "local-1", "local-3"])
    assert plan2.devices == ("local-0", "local-1", "local-2") and p2.gateway == "local-0"
    assert plan2.widths == plan.widths and [d.time for d in p2.devices] == [d.time for d in problem.devices]
    check(p2, plan2)
    assert on_agents(p2, plan2, ["local-0", "local-1", "local-2"]) == (p2, plan2)
    with pytest.raises(SpatialInputError, match="the plan uses 3 devices but 2 agent"):
        on_agents(problem, plan, ["local-0", "local-1"])
