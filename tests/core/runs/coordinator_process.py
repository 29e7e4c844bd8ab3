"""A coordinator in its own process, for the tests that kill or stop one mid-run:
``python -m tests.core.runs.coordinator_process AGENTS_JSON KEYFILE MODEL_DIR`` loads a
two-stage plan, prints ``started`` once the run is going, and prints how it ended."""

from __future__ import annotations

import json
import sys

from agents.protocol import LinkShape
from agents.transport import CurveKeys
from core.errors import RunFailed
from core.planning.plan import plan_from_boundaries
from core.runs.coordinator import AgentEndpoint, Coordinator, NullSink, RunRequest

PROMPT = (5, 17, 33, 9, 101, 250)
LEASE_S = 1.5


class _SayStarted(NullSink):
    said = False

    def on_tokens(self, tokens) -> None:
        if not self.said:
            self.said = True
            print("started", flush=True)


def main() -> int:
    endpoints = [AgentEndpoint(**e) for e in json.loads(sys.argv[1])]
    keys = CurveKeys.load(sys.argv[2])
    # the lease on the tests' clock: half the default 3 s (renewed by the 0.2 s pings), so the
    # agents give up a killed or stopped coordinator's run sooner; the behaviour is the same
    with Coordinator(endpoints, keys, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, lease_s=LEASE_S) as co:
        plan = plan_from_boundaries("tiny-llama", 6, [e.device for e in endpoints], [3])
        slow = LinkShape(latency_ms=20)  # ~40 ms a token: the run lasts a minute
        co.load(plan, sys.argv[3], links={e.device: slow for e in endpoints})
        request = RunRequest(input_ids=(PROMPT,), attention_mask=((1,) * len(PROMPT),), max_new_tokens=1500,
                             mode="sequential", eos_token_ids=(), pad_token_id=0)
        try:
            co.run(plan, request, _SayStarted())
        except RunFailed as err:
            print(f"failed: {err}", flush=True)
            return 1
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
