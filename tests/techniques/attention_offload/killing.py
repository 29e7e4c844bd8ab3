"""Kill a memory agent (SIGKILL) while a run decodes, and time how long the run takes to fail."""

from __future__ import annotations

import os
import signal
import threading
import time


def kill_mid_decode(coordinator, cluster, device: str, run) -> tuple[Exception | None, float]:
    """Start ``run()`` on a thread, SIGKILL ``device``'s agent once the run decodes; return the error
    the run ended with (None if it did not fail) and the seconds from the kill to that end."""
    outcome: dict = {}

    def target():
        try:
            run()
        except Exception as err:  # noqa: BLE001  (the caller asserts on its type)
            outcome["error"] = err
        outcome["end"] = time.monotonic()

    worker = threading.Thread(target=target)
    worker.start()
    deadline = time.monotonic() + 60
    while type(coordinator.latest_run_state).__name__ != "Decoding":
        assert worker.is_alive() and time.monotonic() < deadline, "the run never started decoding"
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(cluster.pid_of(device), signal.SIGKILL)
    worker.join(timeout=90)
    assert not worker.is_alive(), "the run did not end after its memory agent was killed"
    return outcome.get("error"), outcome["end"] - killed
