"""The agents' fork server on its own: it forks real agent processes on request, reports how
each ended, and a launcher learns at once when it cannot start."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from agents.transport import CurveKeys
from agents.zygote import ForkedAgent, ZygoteClient, ZygoteUnavailable, agent_environment

READY = "EDGESHARD-AGENT-READY"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("zygote")
    z = ZygoteClient(env=agent_environment(1), cwd=str(workdir), log_path=str(workdir / "zygote.log"))
    z.start()
    z.wait_ready(120)
    yield z
    z.close()
    assert z.popen.returncode == 0


def _serve(zygote: ZygoteClient, cwd, device: str) -> ForkedAgent:
    argv = ["serve", "--device", device, "--host", "127.0.0.1", f"--coordinator-key={CurveKeys.generate().public}",
            "--exit-on-stdin-eof", "--threads", "1"]
    return zygote.spawn(argv, agent_environment(1), str(cwd))


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_forked_agent_is_its_own_process_and_session_and_listens(zygote, tmp_path):
    agent = _serve(zygote, tmp_path, "fork-a")
    try:
        line = agent.stdout.readline()
        assert line.startswith(READY) and f"pid={agent.pid}" in line and "device=fork-a" in line
        assert agent.pid not in (os.getpid(), zygote.pid)
        assert _parent_of(agent.pid) == zygote.pid
        assert os.getsid(agent.pid) == agent.pid  # its own session: a terminal's Ctrl-C is not its
        assert os.readlink(f"/proc/{agent.pid}/cwd") == str(tmp_path)
        assert agent.poll() is None
    finally:
        agent.stdin.close()  # end-of-file on its stdin: it stops on its own
    assert agent.wait(30) == 0
    agent.close()


def test_a_killed_agent_s_exit_status_is_reported_like_popen(zygote, tmp_path):
    agent = _serve(zygote, tmp_path, "fork-b")
    assert agent.stdout.readline().startswith(READY)
    agent.kill()
    assert agent.wait(30) == -signal.SIGKILL
    agent.kill()  # once it ended, a signal goes nowhere (the pidfd names that process only)
    agent.close()


def test_an_agent_refusing_its_command_line_exits_with_status_2(zygote, tmp_path):
    agent = zygote.spawn(["serve", "--device", "x"], agent_environment(1), str(tmp_path))  # no --coordinator-key
    assert agent.wait(30) == 2
    assert "--coordinator-key" in agent.stdout.read()
    agent.close()


def test_a_zygote_that_cannot_start_is_reported_with_its_exit_status(tmp_path):
    z = ZygoteClient(python="/bin/false", cwd=str(tmp_path))
    z.start()
    with pytest.raises(ZygoteUnavailable, match=r"exited \(status 1\)"):
        z.wait_ready(30)
    with pytest.raises(ZygoteUnavailable):
        z.spawn(["serve"], {}, str(tmp_path))


def test_a_local_agent_imports_the_launchers_own_code_before_any_other_copy(tmp_path):
    import agents

    own = str(Path(agents.__file__).resolve().parent.parent)
    env = agent_environment(1, {"PYTHONPATH": os.pathsep.join([str(tmp_path / "stale-install"), own])})
    assert env["PYTHONPATH"].split(os.pathsep) == [own, str(tmp_path / "stale-install")]


def test_a_forked_agent_is_named_after_its_device_in_ps_and_top_not_the_zygote(zygote, tmp_path):
    agent = _serve(zygote, tmp_path, "fork-t")
    try:
        assert agent.stdout.readline().startswith(READY)
        with open(f"/proc/{agent.pid}/comm") as f:
            assert f.read().strip() == "agent fork-t"  # top, ps -e, pgrep
        with open(f"/proc/{agent.pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode()
        assert cmdline.startswith("edgeshard agent fork-t: python -m agents serve --device fork-t")  # ps -f, top -c
        assert "zygote" not in cmdline
    finally:
        agent.stdin.close()
    assert agent.wait(30) == 0
    agent.close()


def test_the_zygote_reports_how_long_its_imports_took(zygote):
    """Its ready report says where the demo's start-up goes (torch, the agent, the model code)."""
    assert set(zygote.report["imports_s"]) == {"torch", "agent", "model_code"}
    assert all(v > 0 for v in zygote.report["imports_s"].values()) and zygote.report["cpu_s"] > 0
    assert 0 < zygote.started_at <= zygote.ready_at
    assert zygote.report["model_code_imported"] is True  # by default its agents have transformers at once


def test_a_zygote_told_not_to_preload_forks_agents_before_importing_the_model_code(tmp_path):
    """Decided after it started (the demo knows only once it found its kept profile); the agents
    it forks then import the model code themselves, in the background."""
    z = ZygoteClient(env=agent_environment(1), cwd=str(tmp_path), preload_model_code=None)
    z.start()
    try:
        z.preload(False)
        z.preload(True)  # the first word counts
        z.wait_ready(120)
        assert z.report["model_code_imported"] is False and not z.preloads_model_code
        agent = _serve(z, tmp_path, "fork-lazy")
        assert agent.stdout.readline().startswith(READY)
        agent.stdin.close()
        assert agent.wait(30) == 0
        agent.close()
    finally:
        z.close()


def test_no_early_zygote_is_started_when_agents_are_started_as_interpreters(tmp_path, monkeypatch):
    from agents.zygote import LAUNCHER_ENV, start_early_zygote

    monkeypatch.setenv(LAUNCHER_ENV, "popen")
    assert start_early_zygote(str(tmp_path / "cluster")) is None
    assert not (tmp_path / "cluster").exists()
