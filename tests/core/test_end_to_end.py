"""The whole operator flow on emulated devices, for real:

testbed up (3 devices, one link at 10 Mbit/s) → discover the devices over mDNS → deploy
the agent over SSH (key auth, host keys checked against the devices' own key files) →
profile compute and every link → solve a plan → upload each stage's tensors → run the
model on the 3 devices → tokens equal the unpartitioned model's generate() → the shaped
link was measured within ±10 % → testbed down leaves no namespace, process or qdisc.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from .conftest import needs_root
from .hf_reference import hf_greedy_new_tokens

pytestmark = [pytest.mark.netns, needs_root]

NAME, SUBNET = "ese2e", "10.84.0.0/24"
SHAPED = ("ese2e1", "ese2e2", 10.0)
PROMPTS = ["the river runs", "a cat sat on the mat and looked"]
MAX_NEW = 6


def _fingerprint(pub: str) -> str:
    return subprocess.run(["ssh-keygen", "-lf", pub], capture_output=True, text=True, check=True).stdout.split()[1]


def test_discover_deploy_profile_plan_run_on_the_netns_testbed(tmp_path):
    from agents.transport import CurveKeys  # noqa: F401  (agents package importable here)
    from core.devices import deploy
    from core.devices import testbed as tb
    from core.models.checkpoints import ModelRecipe, make_model
    from core.runs.coordinator import Coordinator, RunRequest
    from core.devices.discovery import DeviceDiscovery
    from core.runs.generation import load_tokenizer
    from core.devices.local_cluster import load_agents_file
    from core.planning.problem import PlanningProblem, Workload
    from core.devices.profiling import profile_cluster
    from core.planning.solvers import solve_min_latency

    state_root = tmp_path / "state"
    links = tb.LinksFile(links=(tb.LinkCap(src=SHAPED[0], dst=SHAPED[1], bandwidth_mbit_s=SHAPED[2]),))
    state = tb.testbed_up(3, links=links, name=NAME, subnet=SUBNET, state_root=state_root)
    pids_seen: set[int] = set()
    try:
        names = [d.name for d in state.devices]

        # 1. discover the devices over mDNS (on the testbed bridge only)
        with DeviceDiscovery(interfaces=[state.bridge]) as disc:
            assert disc.wait_for(lambda ds: set(names) <= {d.id for d in ds}, 10), disc.devices()
            found = {d.id: d for d in disc.devices() if d.id in names}
        devices = [f.to_cluster_device(memory_bytes=0) for f in found.values()]
        assert sorted(d.address for d in devices) == sorted(d.address for d in state.devices)

        # 2. deploy over SSH: key auth, host keys accepted only if they match the devices' key files
        expected = {d.address: _fingerprint(d.host_key_path + ".pub") for d in state.devices}
        shown = []

        def operator_checks(info):
            shown.append(info.fingerprint)
            return expected.get(info.host) == info.fingerprint

        ws = tmp_path / "workspace"
        opts = deploy.DeployOptions(python=sys.executable, remote_dir=str(tmp_path / "remote" / "{device}"))
        results = deploy.deploy_many(devices, user=state.ssh_user, key_file=state.operator_key, workspace=ws,
                                     options=opts, trust_new_host_keys=operator_checks, use_agent=False,
                                     user_known=Path("/nonexistent"))
        assert all(not isinstance(r, Exception) for r in results.values()), results
        assert sorted(shown) == sorted(expected.values())
        pids_seen |= {r.record.pid for r in results.values()}
        with DeviceDiscovery(interfaces=[state.bridge]) as disc:  # the agents announce themselves
            assert disc.wait_for(lambda ds: sum(1 for d in ds if d.agent and d.agent.control_port == 47000) == 3, 10)

        # 3. profile compute (synthetic weights on the devices) and every ordered link
        recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=7)
        model_dir = make_model(recipe, tmp_path / "tiny-llama")
        config = json.loads((model_dir / "config.json").read_text())
        endpoints, keys = load_agents_file(ws / "agents.json")
        with Coordinator(endpoints, keys, heartbeat_timeout_s=30) as coord:
            coord.wait_ready(timeout_s=30)
            prof = profile_cluster(coord, config, model_name="tiny-llama", prompt_tokens=8, batch_sizes=(1,),
                                   repeats=2, link_target_s=1.0, out_path=tmp_path / "profile.json")
        measured = {(m.src, m.dst): m.bandwidth_mbit_s for m in prof.links}
        assert len(measured) == 6
        print(f"e2e: shaped {SHAPED[2]} Mbit/s link measured at {measured[SHAPED[:2]]:.2f} Mbit/s; "
              f"others {sorted(round(v) for k, v in measured.items() if k != SHAPED[:2])}")
        assert abs(measured[SHAPED[:2]] - SHAPED[2]) <= 0.1 * SHAPED[2]

        # 4. plan: emulate memory-poor edge devices (each holds under half the weights) so
        #    the exact solver must shard over all three
        profile = prof.profile
        budget = int(profile.model.param_bytes * 0.45)
        small = msgspec.structs.replace(profile.cluster, devices=tuple(
            msgspec.structs.replace(d, memory_bytes=budget) for d in profile.cluster.devices))
        problem = PlanningProblem(profile=msgspec.structs.replace(profile, cluster=small), source=names[0],
                                  workload=Workload(prompt_tokens=8, generated_tokens=MAX_NEW))
        plan = solve_min_latency(problem).plan
        assert len(plan.stages) == 3 and plan.stages[0].device == names[0]

        # 5. upload only each stage's tensors to its device
        model_dirs = {}
        for s in plan.stages:
            dev = state.device(s.device)
            target = deploy.SshTarget(dev.name, dev.address, 22, state.ssh_user)
            policy = deploy.HostKeyPolicy(workspace_known_hosts=ws / "known_hosts", user_known_hosts=None)
            with deploy.connect(target, deploy.SshAuth(key_file=state.operator_key, use_agent=False), policy) as ssh:
                model_dirs[s.device] = deploy.upload_stage_checkpoint(
                    ssh, model_dir, s.start, s.end, str(tmp_path / "remote" / s.device / "model"),
                    tmp_path / "stage-cache")

        # 6. run on the three devices; the tokens are the whole model's
        tok = load_tokenizer(str(model_dir))
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        request = RunRequest(input_ids=tuple(map(tuple, enc["input_ids"].tolist())),
                             attention_mask=tuple(map(tuple, enc["attention_mask"].tolist())),
                             max_new_tokens=MAX_NEW, mode="sequential", eos_token_ids=(2,), pad_token_id=0)
        with Coordinator(endpoints, keys, heartbeat_timeout_s=30) as coord:
            coord.load(plan, model_dirs)
            result = coord.run(plan, request)
        assert list(result.tokens) == hf_greedy_new_tokens(str(model_dir), enc, MAX_NEW)
        assert {e.device for e in result.events} == set(names)
        for ns in (d.namespace for d in state.devices):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            pids_seen |= {int(p) for p in out.split()}
    finally:
        tb.testbed_down(NAME, state_root=state_root)
    # 7. nothing left: namespaces, links, qdiscs, processes
    assert tb.leftovers(NAME) == []
    alive = [p for p in pids_seen if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0] != "Z"]
    assert alive == []
