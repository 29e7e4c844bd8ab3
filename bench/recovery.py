"""Recovery of a run whose device dies mid-decode: prints one JSON line.

Three local agents (real processes, CurveZMQ) run a tiny generated Llama split 2/2/2 units,
15 ms emulated latency per hop, heartbeats every 0.5 s with the coordinator's default 2 s
timeout. For greedy and for seeded sampling: an undisturbed run, then the same run with the
last stage's agent killed (SIGKILL) once decode step 8 is back; the coordinator re-plans over
the survivors with the exact solver (``core.runs.recovery.ExactReplanner``), loads the new
shards, rebuilds the KV caches by prefill over prompt + tokens so far and finishes. Per case:

- detection_s: from the kill to the re-plan starting (heartbeat timeout, then the failure path: the
  survivors stopped, the lost agents asked once);
- replan_s: the exact re-plan;  shard_load_s: loading the re-planned shards;
- death_to_next_token_s: from the kill to the resumed run's first token (the first after the reload);
- tokens_equal: the recovered run's tokens == the undisturbed run's.

A third case, ``reported``: in-process agents (``agents.agent.Agent``), greedy; c is closed at decode step 8
and b, alive, reports losing its peer c before the heartbeats decide (a stage that notices its peer first,
as attention offloading's monitored links do): the run ends on b's error while c is not yet declared lost,
so the failure path itself must find c (its port refuses connections) rather than wait on its replies.

Run: python bench/recovery.py   (numbers are wall times on a shared machine: see loadavg)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agents.protocol import LinkShape, SamplingSpec, TimelineEvent, TokenEvent  # noqa: E402
from core.devices.local_cluster import LocalCluster  # noqa: E402
from core.models.checkpoints import ModelRecipe, make_model  # noqa: E402
from core.models.units import load_model_spec  # noqa: E402
from core.planning.plan import plan_from_boundaries  # noqa: E402
from core.planning.problem import Workload  # noqa: E402
from core.planning.scenarios import DeviceSpec, synthetic_problem  # noqa: E402
from core.runs.coordinator import Coordinator, RunRequest  # noqa: E402
from core.runs.recovery import ExactReplanner  # noqa: E402

DEVICES = ["a", "b", "c"]
PROMPTS = ((5, 17, 33, 9, 101, 250), (0, 0, 7, 8, 9, 10))
MASKS = ((1,) * 6, (0, 0, 1, 1, 1, 1))
KILL_AT_STEP = 8


class _Killer:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.killed_at: float | None = None
        self.killed_run_s = 0.0
        """The kill on the run's clock (the token that triggered it arrived just before)."""
        self.after: float | None = None
        self.reloaded = False

    def on_event(self, event: TimelineEvent) -> None:
        self.reloaded = self.reloaded or event.kind == "reload"  # drawn just before the resumed segment starts

    def on_tokens(self, tokens: TokenEvent) -> None:
        if self.killed_at is None and tokens.step >= KILL_AT_STEP:
            self.killed_at = time.time()
            self.killed_run_s = tokens.t_s
            self.kill()
        elif self.reloaded and self.after is None:
            self.after = time.time()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


class _ReportedLoss(_Killer):
    """c closed, then b reporting it lost its peer c (before any heartbeat runs out)."""

    def __init__(self, agents: dict) -> None:
        super().__init__(0)
        self.agents = agents

    def kill(self) -> None:  # not on the link's IO thread, which delivered the token
        threading.Thread(target=self._lose_c, daemon=True).start()

    def _lose_c(self) -> None:
        from agents.protocol import RunError

        self.agents["c"].close()
        self.agents["b"].post(RunError(run_id=self.agents["b"].run_id, device="b", message="lost its peer c"))


def _request(sampling: SamplingSpec) -> RunRequest:
    return RunRequest(input_ids=PROMPTS, attention_mask=MASKS, max_new_tokens=40, mode="no-bubbles",
                      micro_batches=2, eos_token_ids=(), pad_token_id=0, sampling=sampling)


def _case(workdir: str, model_dir: str, sampling: SamplingSpec) -> dict:
    problem = _problem(model_dir)
    with LocalCluster(workdir, DEVICES) as cluster, Coordinator(cluster.endpoints, cluster.keys) as co:
        plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4])
        co.load(plan, model_dir, links={d: LinkShape(latency_ms=15) for d in DEVICES})
        undisturbed = co.run(plan, _request(sampling))
        return _recovered(co, plan, sampling, problem, _Killer(cluster.pid_of("c")), undisturbed)


def _reported_case(model_dir: str) -> dict:
    """The ``reported`` case: in-process agents, b reports losing c before the heartbeats decide."""
    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core.runs.coordinator import AgentEndpoint

    keys = CurveKeys.generate()
    agents = {d: Agent(d, keys.public).start() for d in DEVICES}
    try:
        endpoints = [AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents.values()]
        with Coordinator(endpoints, keys) as co:
            plan = plan_from_boundaries("tiny-llama", 6, DEVICES, [2, 4])
            co.load(plan, model_dir, links={d: LinkShape(latency_ms=15) for d in DEVICES})
            undisturbed = co.run(plan, _request(SamplingSpec()))
            return _recovered(co, plan, SamplingSpec(), _problem(model_dir), _ReportedLoss(agents), undisturbed)
    finally:
        for a in agents.values():
            a.close()


def _problem(model_dir: str):
    spec = load_model_spec(model_dir, "fp32", name="tiny-llama")
    return synthetic_problem([DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=1.0)
                              for d in DEVICES], spec,
                             workload=Workload(prompt_tokens=6, generated_tokens=40, batch_size=2))


def _recovered(co: Coordinator, plan, sampling: SamplingSpec, problem, killer: _Killer, undisturbed) -> dict:
    recovered = co.run(plan, _request(sampling), killer, replan=ExactReplanner(problem))
    (rec,) = recovered.recoveries
    return {
        "detection_s": round(rec.detected_s - killer.killed_run_s, 3),
        "replan_s": round(rec.replanned_s - rec.detected_s, 3),
        "shard_load_s": round(rec.loaded_s - rec.replanned_s, 3),
        "death_to_next_token_s": round(killer.after - killer.killed_at, 3) if killer.after else None,
        "new_stages": list(rec.new_stages),
        "tokens_equal": recovered.tokens == undisturbed.tokens,
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=13)
        model_dir = str(make_model(recipe, os.path.join(tmp, "tiny-llama")))
        out = {
            "greedy": _case(os.path.join(tmp, "greedy"), model_dir, SamplingSpec()),
            "seeded": _case(os.path.join(tmp, "seeded"), model_dir, SamplingSpec(temperature=0.9, top_p=0.9, seed=7)),
            "reported": _reported_case(model_dir),
        }
    out["tokens_equal"] = {k: v["tokens_equal"] for k, v in out.items()}
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))


if __name__ == "__main__":
    threading.current_thread().name = "bench-recovery"
    main()
