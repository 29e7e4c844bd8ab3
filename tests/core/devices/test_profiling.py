"""Cluster profiling from the coordinator: compute on every agent, every ordered link over
the agents' data plane, a Profile that `edgeshard plan` reads."""

from __future__ import annotations

import json

import pytest

from core.cli import main
from core.formats import load
from core.devices.profile import Profile
from core.devices.profiling import ProfilingFailed, build_profile

from tests.core.conftest import SHAPED_LINK, needs_root

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def test_profile_of_a_local_cluster_is_saved_and_planned_by_edgeshard_plan(tmp_path, capsys):
    """Two loopback agents whose outgoing links emulate 40 Mbit/s and 2 ms (no root)."""
    from core.devices.local_cluster import LocalCluster

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "profile.json"
    with LocalCluster(tmp_path / "cluster", 2, link_mbit=40, link_latency_ms=2.0) as lc:
        rc = main(["profile", "--agents", str(lc.agents_file), "--model", str(cfg), "--out", str(out),
                   "--repeats", "2", "--batch-sizes", "1", "--prompt-tokens", "8", "--link-seconds", "0.5"])
    assert rc == 0
    profile = load(out, Profile)
    assert profile.source == "measured" and profile.model.num_units == 4
    assert {t.device for t in profile.times} == {"local-0", "local-1"}
    assert all(len(t.decode_s) == 4 and all(x > 0 for u in t.decode_s for x in u) for t in profile.times)
    assert all(d.memory_bytes > 0 for d in profile.cluster.devices)
    assert all(t.cache_timing in ("cold", "warm") for t in profile.times)  # how each agent timed its units
    links = {(l.src, l.dst): l for l in profile.cluster.links}
    assert set(links) == {("local-0", "local-1"), ("local-1", "local-0")}
    for l in links.values():
        print(f"emulated 40 Mbit/s 2 ms link {l.src}->{l.dst}: {l.bandwidth_mbit_s:.2f} Mbit/s, "
              f"{l.latency_ms:.2f} ms one way")
        assert abs(l.bandwidth_mbit_s - 40) <= 4
        assert 2.0 <= l.latency_ms <= 12.0
    capsys.readouterr()
    assert main(["plan", str(out), "--objective", "latency", "--json"]) == 0
    plan_out = json.loads(capsys.readouterr().out)
    assert plan_out


def test_a_profile_needs_figures_for_every_unit():
    from agents.protocol import ComputeProfile, UnitTimes

    u = UnitTimes(unit=0, decode_s=(1e-3,), decode_spread=(0.0,), prefill_s=(1e-3,), prefill_spread=(0.0,),
                  param_bytes=1)
    c = ComputeProfile(device="a", decode_batch_sizes=(1,), prefill_token_counts=(8,), units=(u,),
                       memory_budget_bytes=1, memory_total_bytes=1, memory_available_bytes=1, accelerator="",
                       threads=1, seconds=0.0)
    with pytest.raises(ProfilingFailed, match=r"units \[1, 2, 3\]"):
        build_profile(TINY, {"a": c}, [], dtype="fp32", model_name="t", prompt_tokens=8)


def test_the_measured_stage_overhead_is_carried_into_the_profile():
    from agents.protocol import ComputeProfile, UnitTimes

    units = tuple(UnitTimes(unit=i, decode_s=(1e-3,), decode_spread=(0.0,), prefill_s=(2e-3,), prefill_spread=(0.0,),
                            param_bytes=1) for i in range(4))
    c = ComputeProfile(device="a", decode_batch_sizes=(1,), prefill_token_counts=(8,), units=units,
                       memory_budget_bytes=1, memory_total_bytes=1, memory_available_bytes=1, accelerator="",
                       threads=1, seconds=0.0, stage_decode_overhead_s=1.5e-4, stage_prefill_overhead_s=2.5e-4)
    times = build_profile(TINY, {"a": c}, [], dtype="fp32", model_name="t", prompt_tokens=8).times_of("a")
    assert (times.stage_decode_overhead_s, times.stage_prefill_overhead_s) == (1.5e-4, 2.5e-4)


def test_how_each_device_was_timed_is_carried_into_the_profile():
    from agents.protocol import ComputeProfile, UnitTimes

    units = tuple(UnitTimes(unit=i, decode_s=(1e-3,), decode_spread=(0.0,), prefill_s=(2e-3,), prefill_spread=(0.0,),
                            param_bytes=1) for i in range(4))
    why = "overwriting the 480 MiB last-level cache takes 960 MiB; profiling may add 88 MiB (MemAvailable)"
    compute = {d: ComputeProfile(device=d, decode_batch_sizes=(1,), prefill_token_counts=(8,), units=units,
                                 memory_budget_bytes=1, memory_total_bytes=1, memory_available_bytes=1, accelerator="",
                                 threads=1, seconds=0.0, cache_timing=wire)
               for d, wire in (("a", "cold"), ("b", f"warm: {why}"), ("c", ""))}
    profile = build_profile(TINY, compute, [], dtype="fp32", model_name="t", prompt_tokens=8)
    assert [(t.cache_timing, t.warm_reason) for t in profile.times] == [("cold", ""), ("warm", why), ("", "")]


@pytest.mark.netns
@needs_root
def test_tc_shaped_testbed_link_is_measured_within_ten_percent_over_the_data_plane(deployed):
    from agents.protocol import PeerSpec
    from agents.transport import CurveKeys
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from core.devices.profiling import measure_links

    src, dst, mbit = SHAPED_LINK
    keys = CurveKeys.load(deployed.workspace / "coordinator.key")
    eps = [AgentEndpoint(d, deployed.results[d].record.control_address, deployed.results[d].record.public_key)
           for d in (src, dst)]
    with Coordinator(eps, keys) as coord:
        st = coord.status()
        peers = {d: PeerSpec(device=d, stage=0, data_address=s.data_address, public_key=s.public_key)
                 for d, s in st.items()}
        links = {(m.src, m.dst): m for m in measure_links(coord, peers, offsets={})}
    shaped, reverse = links[(src, dst)], links[(dst, src)]
    print(f"tc-shaped {mbit} Mbit/s link {src}->{dst} measured at {shaped.bandwidth_mbit_s:.2f} Mbit/s "
          f"over the agents' data plane; reverse (unshaped) {reverse.bandwidth_mbit_s:.0f} Mbit/s")
    assert abs(shaped.bandwidth_mbit_s - mbit) <= 0.1 * mbit
    assert reverse.bandwidth_mbit_s > 5 * mbit


def test_compute_profiling_reports_each_agent_and_the_unit_it_is_at(monkeypatch):
    """The operator sees which agent is profiling which unit, not one silent bar per cluster."""
    import threading

    from agents import profiler
    from agents.agent import Agent
    from agents.protocol import ComputeOptions
    from agents.transport import CurveKeys
    from core.devices.profiling import profile_compute
    from core.models.checkpoints import ModelRecipe, build_config
    from core.reporting import RecordingReporter
    from core.runs.coordinator import AgentEndpoint, Coordinator

    shown = {d: threading.Event() for d in ("dev-a", "dev-b")}

    class Watching(RecordingReporter):
        def status(self, text: str) -> None:
            super().status(text)
            for d, event in shown.items():
                if text.startswith(f"{d}: profiling compute: unit "):
                    event.set()

    real = profiler.profile_units

    def held_at_its_first_unit(opts, device="", progress=None, **kw):
        """A quiet host profiles this model between two status polls (0.3 s apart) and the activity is
        cleared before the reply: each agent waits at its first unit until the operator was shown it."""
        def gated(done: int, total: int) -> None:
            progress(done, total)
            if done == 1:
                shown[device].wait(60)
        return real(opts, device=device, progress=gated, **kw)

    monkeypatch.setattr(profiler, "profile_units", held_at_its_first_unit)
    config = build_config(ModelRecipe(family="llama", layers=8, hidden=192, heads=4, vocab=512)).to_dict()
    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in ("dev-a", "dev-b")]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            rep = Watching()
            options = ComputeOptions(config=config, prompt_tokens=32, batch_sizes=(1, 2), repeats=5)
            out = profile_compute(co, ["dev-a", "dev-b"], options, rep)
    finally:
        for a in agents:
            a.close()
    assert sorted(out) == ["dev-a", "dev-b"]
    for dev in ("dev-a", "dev-b"):
        units = [s for s in rep.statuses if s.startswith(f"{dev}: profiling compute: unit ")]
        assert units, rep.statuses
    assert [p for p in rep.progresses if 0 < p[0] < 1]  # progress moved within the first device
    assert rep.progresses[-1] == (2, 2)


class _SerialisingLinkCoordinator:
    """Answers ``MeasureLink`` pairs as a link of ``mbit`` Mbit/s would: each probe takes
    ``probe_bytes`` / rate to send, waits behind the probes before it, a new connection's
    handshake holds the link for ``handshake_s``, and arrival is ``propagation_s`` later."""

    def __init__(self, mbit: float, probe_bytes: int, handshake_s: float, propagation_s: float):
        self.mbit, self.probe_bytes = mbit, probe_bytes
        self.handshake_s, self.propagation_s = handshake_s, propagation_s
        self.receivers: dict[str, object] = {}

    def request_async(self, device, msg):
        import concurrent.futures as cf

        from agents.protocol import LinkResult, ProfileResult

        fut = cf.Future()
        o = msg.options
        if o.role == "receive":
            self.receivers[o.probe_id] = (fut, device)
            return fut
        send_s = self.probe_bytes * 8 / (self.mbit * 1e6)
        free, one_way = self.handshake_s, []
        for i in range(o.latency_probes):
            sent = i * o.latency_gap_s
            free = max(sent, free) + send_s
            one_way.append(free + self.propagation_s - sent)
        recv_fut, recv_dev = self.receivers.pop(o.probe_id)
        recv_fut.set_result(ProfileResult(result=LinkResult(
            role="receive", probe_id=o.probe_id, bytes_received=o.nbytes, bandwidth_mbit_s=self.mbit,
            one_way_s=tuple(one_way), seconds=1.0)))
        fut.set_result(ProfileResult(result=LinkResult(role="send", probe_id=o.probe_id, seconds=1.0)))
        return fut


def test_compute_profiled_together_gives_every_agent_its_figures_and_one_bar_to_the_end():
    """The demo's agents profile at once (each timed by its own CPU time): every device's units
    come back, the statuses name each agent, the bar never goes back and ends full."""
    from agents.agent import Agent
    from agents.protocol import ComputeOptions
    from agents.transport import CurveKeys
    from core.devices.profiling import profile_compute
    from core.reporting import RecordingReporter
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: F401 (in-process agents: one
    # interpreter, whose lazy imports two profiling threads would race for; real agents are processes)

    keys = CurveKeys.generate()
    agents = [Agent(d, keys.public).start() for d in ("dev-a", "dev-b")]
    try:
        with Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys) as co:
            rep = RecordingReporter()
            options = ComputeOptions(config=TINY, prompt_tokens=4, batch_sizes=(1,), repeats=1, warmup=0, units=(1,),
                                     threads=1)
            out = profile_compute(co, ["dev-a", "dev-b"], options, rep, together=True)
    finally:
        for a in agents:
            a.close()
    assert sorted(out) == ["dev-a", "dev-b"]
    assert all([u.unit for u in p.units] == [1] and p.units[0].decode_s[0] > 0 for p in out.values())
    assert any("dev-a" in s and "dev-b" in s for s in rep.statuses), rep.statuses
    done = [p[0] for p in rep.progresses]
    assert done == sorted(done) and rep.progresses[-1] == (2, 2)


def test_a_slow_links_latency_is_a_small_messages_one_way_time_not_the_probes_queueing():
    """At 0.5 Mbit/s a 300-byte probe takes 4.8 ms to send: probes 5 ms apart behind a 16 ms
    handshake queued, and the profile's "latency" (~20 ms) was their queueing, which the cost
    model then paid on top of bytes / bandwidth for every hop (the miniature's Cloud-Edge-Even)."""
    from agents.protocol import PeerSpec
    from core.devices.profiling import measure_links

    link = _SerialisingLinkCoordinator(mbit=0.5, probe_bytes=300, handshake_s=0.016, propagation_s=0.0003)
    peers = {d: PeerSpec(device=d, stage=0, data_address=f"tcp://{d}:1", public_key="k" * 40) for d in ("a", "b")}
    measured = measure_links(link, peers, first_probe_bytes=1024, offsets={})
    small_message_s = 300 * 8 / 0.5e6 + 0.0003
    for m in measured:
        assert m.one_way_ms == pytest.approx(small_message_s * 1e3, rel=0.05)


def test_latency_probes_are_spaced_for_their_own_sending_time_on_slow_links_only():
    from agents.protocol import LinkOptions
    from core.devices.profiling import PROBE_WIRE_BYTES, latency_probe_gap_s

    default = LinkOptions(role="send").latency_gap_s
    assert latency_probe_gap_s(0.5) >= 2 * PROBE_WIRE_BYTES * 8 / 0.5e6
    assert latency_probe_gap_s(50.0) == default
    assert latency_probe_gap_s(0.0) == default


def test_a_cancel_ends_the_wait_for_a_profiling_reply_at_once():
    """Quitting mid-profile: the worker waiting on an agent's reply ends when cancelled, not at
    its next status poll (the studio joins it while quitting)."""
    import concurrent.futures as cf
    import threading

    from agents.protocol import GetStatus
    from core.devices.profiling import _follow_progress
    from core.reporting import Cancelled, RecordingReporter

    polled = threading.Event()

    class Coord:
        def request_async(self, device, msg):
            assert isinstance(msg, GetStatus)
            polled.set()
            return cf.Future()  # never answered

    rep, ended = RecordingReporter(), []

    def follow():
        try:
            _follow_progress(Coord(), "dev-a", cf.Future(), rep, 0, 1, timeout_s=3600, poll_s=3600)
        except Cancelled:
            ended.append("cancelled")

    worker = threading.Thread(target=follow, daemon=True)
    worker.start()
    assert polled.wait(30)  # it is now waiting, with its next poll an hour away
    rep.cancel()
    worker.join(60)
    assert ended == ["cancelled"]
