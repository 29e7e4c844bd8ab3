"""For tests that a command refuses bad input at its entrance: before any agent is started
(a local cluster built) or connected to (a coordinator or agent link made), one line, exit 2."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from agents.transport import CurveKeys
from core.cli import main as cli_main


def forbid_agents(monkeypatch) -> None:
    """Fail the test as soon as a local cluster is built or any agent is connected to."""
    import core.devices.agent_link
    import core.devices.local_cluster
    import core.runs.coordinator

    def refuse(*_a, **_k):
        pytest.fail("an agent was started or connected to before the input was checked")

    for cls in (core.devices.local_cluster.LocalCluster, core.runs.coordinator.Coordinator,
                core.devices.agent_link.AgentLink):
        monkeypatch.setattr(cls, "__init__", refuse)


def refused(argv, capsys) -> str:
    """Run the CLI; assert exit status 2, one line on stderr, nothing on stdout; return that line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("edgeshard: error: "), (code, err)
    assert out.getvalue() == ""
    return err


def unreachable_agents_file(folder, devices) -> str:
    """A real agents.json (real keys) listing ``devices`` at loopback ports where nothing listens."""
    key = folder / "coordinator.key"
    CurveKeys.generate().save(key)
    public = CurveKeys.generate().public
    path = folder / "agents.json"
    path.write_text(json.dumps({"format": "edgeshard.agents", "version": 1, "coordinator_key_file": str(key),
                                "agents": [{"device": d, "control_address": f"tcp://127.0.0.1:{1 + i}",
                                            "public_key": public} for i, d in enumerate(devices)]}))
    return str(path)


@contextlib.contextmanager
def cluster_with_a_dead_agent(folder, devices, dead: str):
    """Real local agents ``devices`` whose agent ``dead`` was killed (SIGKILL) and has exited; the
    agents file still lists it, as after a crash. Yields the agents file's path."""
    import os
    import signal
    import time

    from core.devices.local_cluster import LocalCluster

    with LocalCluster(folder, list(devices)) as cluster:
        os.kill(cluster.pid_of(dead), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while dead not in dict(cluster.exited()):
            assert time.monotonic() < deadline, f"{dead} did not exit after SIGKILL"
            time.sleep(0.05)
        yield str(cluster.agents_file)
