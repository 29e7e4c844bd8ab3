"""The agent's entry (``python -m agents serve``): the process environment it starts torch in."""

from __future__ import annotations

import os
import subprocess
import sys

from agents.__main__ import prefer_passive_openmp_wait
from agents.transport import CurveKeys


def test_openmp_workers_sleep_when_the_environment_names_no_wait_policy():
    env: dict[str, str] = {}
    assert prefer_passive_openmp_wait(env, modules={}) is True
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_an_operators_wait_policy_is_left_alone():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert prefer_passive_openmp_wait(env, modules={}) is False
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_an_operators_spin_count_is_left_alone():
    env = {"GOMP_SPINCOUNT": "10000"}
    assert prefer_passive_openmp_wait(env, modules={}) is False
    assert env == {"GOMP_SPINCOUNT": "10000"}


def test_nothing_is_set_once_torch_is_loaded():
    """libgomp read its environment when torch was imported: a later setting would only mislead."""
    env: dict[str, str] = {}
    assert prefer_passive_openmp_wait(env, modules={"torch": object()}) is False
    assert env == {}


def test_the_served_agents_openmp_does_not_spin(tmp_path):
    """End to end: libgomp in a served agent reports a spin count of 0 (its default is 300000),
    so the setting reaches torch's OpenMP before torch loads."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings to stderr when it loads
    cmd = [sys.executable, "-m", "agents", "serve", "--host", "127.0.0.1", "--threads", "1",
           f"--coordinator-key={CurveKeys.generate().public}", "--weights-dir", str(tmp_path / "weights"),
           "--exit-on-stdin-eof"]
    done = subprocess.run(cmd, input="", capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert "GOMP_SPINCOUNT = '0'" in done.stderr, done.stderr[-2000:]


def test_the_agents_zygote_starts_torch_with_openmp_not_spinning(tmp_path):
    """Local agents fork from a zygote that imported torch: the wait policy must be set there."""
    from agents.zygote import ZygoteClient, agent_environment

    env = agent_environment(1, {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")})
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    log = tmp_path / "zygote.log"
    zygote = ZygoteClient(env=env, cwd=str(tmp_path), log_path=str(log))
    zygote.start()
    try:
        zygote.wait_ready(120)
    finally:
        zygote.close()
    assert "GOMP_SPINCOUNT = '0'" in log.read_text(), log.read_text()[-2000:]
