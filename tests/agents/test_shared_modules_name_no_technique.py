"""The agent's shared modules name no technique: a technique is added in its own room and registered
(agents.registry), never by editing the control plane, the lease, the stage run, transport or the
base protocol. Fails when a shared module's source (code, docstrings, comments) names one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

AGENTS = Path(__file__).resolve().parents[2] / "agents"

SHARED = (
    "__init__.py", "__main__.py", "accelerators.py", "agent.py", "announce.py", "arguments.py", "boundary_copy.py",
    "checkpoint_files.py", "checkpoint_reader.py", "clock.py",
    "cold_profiling.py", "heap.py", "shard_positions.py",
    "control_plane.py", "data_frames.py", "emulation.py", "envelope.py", "executors.py", "huge_pages.py",
    "lease.py", "local_pipeline.py", "model_code.py", "process_title.py", "profiling_protocol.py", "protocol.py",
    "profiler.py", "registry.py", "sampling.py", "schedule.py", "shard.py", "stage_input.py", "stage_run.py", "step_inputs.py",
    "transport.py", "weight_precision.py", "weights.py", "zygote.py",
)  # fmt: skip
"""Every module of agents/ outside agents/techniques, listed by name so a new one is a decision."""


TECHNIQUE_WORDS = {
    "spatial partitioning": r"spatial|edgemi|(?<!\.)\bstrips?\b|gateway|classify_?image",
    "attention offloading": r"attention[ _-]?offload|lamina|\"attend(ed)?\"|attend(ed)? frames?|attend_?heads|attendspec|hold_?heads"
                            r"|hold_?dense|memory agents?",
    "its staggered pipelining": r"stagger|\breplicas?\b",
    "expert offloading": r"expert[ _-]?offload|edgemoe",
    "EPD": r"\bepd\b|disaggregat|phase[ _-]?requests?|encode_?tiles|prefill_?prompt|decode_?tokens|llava",
    "the test-only technique": r"whole[ _-]?model",
}
"""Each technique's names, as its own room spells them. Not the model vocabulary every stage shares
(attention mask, phase = prefill/decode, a Mixtral checkpoint's experts, encode a message)."""

ROOMS = {
    "spatial partitioning": [AGENTS / "techniques" / "spatial"],
    "attention offloading": [AGENTS / "techniques" / "attention_offload"],
    "its staggered pipelining": [AGENTS / "techniques" / "attention_offload"],
    "expert offloading": [AGENTS / "techniques" / "expert_offload"],
    "EPD": [AGENTS / "techniques" / "phase_disaggregation"],
    "the test-only technique": [Path(__file__).resolve().parents[1] / "techniques" / "whole_model_agent.py"],
}


def _sources(paths) -> str:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return "\n".join(f.read_text() for f in files)


def test_the_shared_modules_are_every_module_of_agents_outside_the_rooms():
    present = {p.name for p in AGENTS.glob("*.py")}
    assert present == set(SHARED), "a new agents/ module: list it in SHARED (or move it to a room)"


@pytest.mark.parametrize("technique", sorted(TECHNIQUE_WORDS))
def test_each_technique_word_list_matches_its_own_room(technique):
    """The patterns are not vacuous: each finds its technique where it lives."""
    assert re.search(TECHNIQUE_WORDS[technique], _sources(ROOMS[technique]), re.IGNORECASE)


@pytest.mark.parametrize("module", SHARED)
def test_a_shared_agent_module_names_no_technique(module):
    source = (AGENTS / module).read_text()
    assert len(source) > 0
    found = {t: sorted({m.group(0) for m in re.finditer(p, source, re.IGNORECASE)})
             for t, p in TECHNIQUE_WORDS.items() if re.search(p, source, re.IGNORECASE)}
    assert not found, f"agents/{module} names {found}: move it to the technique's room and register it"
