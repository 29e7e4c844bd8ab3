"""The run modes are defined once, by the wire format, and everything that names a mode
(coordinator, simulator, CLI) takes them from there."""

from __future__ import annotations

import pytest

from agents.protocol import RUN_MODES, ProtocolError, StartRun, decode_control, encode_control
from core.runs import coordinator
from core.runs import simulator
from core.cli import main as cli_main


def test_the_coordinator_and_the_simulator_use_the_wire_formats_run_modes():
    assert RUN_MODES == ("sequential", "bubbles", "no-bubbles")
    assert coordinator.MODES is RUN_MODES and simulator.MODES is RUN_MODES
    assert coordinator.Mode is simulator.Mode


def test_a_start_run_in_a_mode_outside_the_run_modes_is_refused_on_decoding():
    for mode in RUN_MODES:
        assert decode_control(encode_control(StartRun(run_id="r", mode=mode, max_new_tokens=1))).mode == mode
    with pytest.raises(ProtocolError):
        decode_control(encode_control(StartRun(run_id="r", mode="fastest", max_new_tokens=1)))


def test_edgeshard_run_offers_exactly_the_run_modes(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        cli_main(["run", "--model", str(tmp_path), "--plan", str(tmp_path / "p.json"), "--local", "--prompt", "x",
                  "--mode", "fastest"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'fastest'" in err and all(f"'{m}'" in err for m in RUN_MODES)
