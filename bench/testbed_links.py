"""Testbed link accuracy and device-setup times; prints one JSON line (needs root).

Brings up a netns testbed of 3 devices whose links from dev1 are capped by tc/htb at
the given rates (dev1→dev2, dev1→dev3; the rest unshaped), deploys the agent to all of
them over SSH (the real path: host keys, upload, detached start, control answer),
measures every ordered pair over the agents' data plane (core.devices.profiling.measure_links)
and compares each capped link with its configured rate. Also times testbed up/down,
the parallel deploy and an idempotent re-deploy.

Usage: sudo python bench/testbed_links.py [--rates 10,50] [--link-seconds 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="10,50", help="Mbit/s of dev1->dev2 and dev1->dev3")
    p.add_argument("--link-seconds", type=float, default=1.0)
    args = p.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"bench": "testbed_links", "skipped": "needs root"}))
        return 0
    from agents.protocol import PeerSpec
    from core.devices import deploy
    from core.devices import testbed as tb
    from core.runs.coordinator import Coordinator
    from core.devices.local_cluster import load_agents_file
    from core.devices.profiling import measure_links

    rates = [float(x) for x in args.rates.split(",")]
    name = "esbench"
    caps = tuple(tb.LinkCap(src=f"{name}1", dst=f"{name}{i + 2}", bandwidth_mbit_s=r) for i, r in enumerate(rates))
    out: dict = {"bench": "testbed_links", "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        state = tb.testbed_up(1 + len(rates), links=tb.LinksFile(links=caps), name=name, subnet="10.86.0.0/24",
                              state_root=tmp / "state", advertise_mdns=False)
        out["testbed_up_s"] = round(time.perf_counter() - t0, 2)
        try:
            ws = tmp / "ws"
            ws.mkdir()
            (ws / "known_hosts").write_text("\n".join(state.known_hosts_lines()) + "\n")
            targets = [deploy.SshTarget(d.name, d.address, 22, state.ssh_user) for d in state.devices]
            opts = deploy.DeployOptions(python=sys.executable, remote_dir=str(tmp / "remote" / "{device}"),
                                        announce=False)
            kw = dict(key_file=state.operator_key, workspace=ws, options=opts, use_agent=False,
                      user_known=Path("/nonexistent"))
            t0 = time.perf_counter()
            res = deploy.deploy_many(targets, **kw)
            out["deploy_parallel_s"] = round(time.perf_counter() - t0, 2)
            errors = {k: str(v) for k, v in res.items() if isinstance(v, Exception)}
            if errors:
                out["deploy_errors"] = errors
                print(json.dumps(out))
                return 1
            t0 = time.perf_counter()
            deploy.deploy_many(targets, **kw)
            out["redeploy_idempotent_s"] = round(time.perf_counter() - t0, 2)
            endpoints, keys = load_agents_file(ws / "agents.json")
            with Coordinator(endpoints, keys, heartbeat_timeout_s=30) as coord:
                st = coord.status()
                peers = {d: PeerSpec(device=d, stage=0, data_address=s.data_address, public_key=s.public_key)
                         for d, s in st.items()}
                t0 = time.perf_counter()
                links = measure_links(coord, peers, link_target_s=args.link_seconds, offsets={})
                out["measure_all_pairs_s"] = round(time.perf_counter() - t0, 2)
            by = {(m.src, m.dst): m for m in links}
            out["shaped"] = [
                {"link": f"{c.src}->{c.dst}", "configured_mbit_s": c.bandwidth_mbit_s,
                 "measured_mbit_s": round(by[(c.src, c.dst)].bandwidth_mbit_s, 2),
                 "error": round(by[(c.src, c.dst)].bandwidth_mbit_s / c.bandwidth_mbit_s - 1, 4)}
                for c in caps]
            shaped_pairs = {(c.src, c.dst) for c in caps}
            out["unshaped_mbit_s"] = {f"{a}->{b}": round(m.bandwidth_mbit_s) for (a, b), m in sorted(by.items())
                                      if (a, b) not in shaped_pairs}
            out["one_way_ms_median"] = round(sorted(m.one_way_ms for m in links)[len(links) // 2], 3)
        finally:
            t0 = time.perf_counter()
            tb.testbed_down(name, state_root=tmp / "state")
            out["testbed_down_s"] = round(time.perf_counter() - t0, 2)
            out["leftovers"] = tb.leftovers(name)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
