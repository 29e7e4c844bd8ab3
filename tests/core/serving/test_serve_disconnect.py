"""A client that disconnects frees its micro-batch at once: the agents' KV cache bytes drop to 0 on
every stage while the server keeps running, and the freed slots serve the next requests (with the
reference tokens). The server runs over a local cluster the test can ask for the agents' status."""

from __future__ import annotations

import time

import openai
import pytest

from core.devices.local_cluster import LocalCluster
from core.runs.coordinator import Coordinator
from tests.core.serving.conftest import API_KEY, DEVICES, Reference, serve_files, start_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-disconnect")
    model, plan = serve_files(folder)
    with LocalCluster(folder / "cluster", DEVICES, threads_per_agent=1) as cluster:
        server = start_server(folder, model, plan, agents=cluster.agents_file)
        try:
            with Coordinator(cluster.endpoints, cluster.keys) as probe:  # only asks the agents for their status
                client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
                yield client, probe, model
        finally:
            assert server.stop() == 0


def _kv_bytes(probe) -> dict[str, int]:
    return {d: s.kv_bytes for d, s in probe.status_of(DEVICES).items()}


def test_clients_that_disconnect_mid_stream_free_their_kv_caches_on_every_stage_at_once(served):
    client, probe, _ = served
    streams = [client.completions.create(model="tiny-llama", prompt=p, max_tokens=150, stream=True)
               for p in ("under the bridge", "over the hill")]  # rows of one micro-batch (rows first)
    for s in streams:
        next(iter(s))
        next(iter(s))
    held = _kv_bytes(probe)
    assert all(b > 0 for b in held.values()), held
    for s in streams:
        s.close()
    deadline = time.monotonic() + 10
    while any(_kv_bytes(probe).values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _kv_bytes(probe) == {d: 0 for d in DEVICES}


def test_the_freed_slots_serve_the_next_requests(served):
    client, _, model = served
    reference = Reference(model)
    for prompt in ("snow fell", "the king said", "we went to"):  # more requests than slots, one after another
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6)
        assert r.choices[0].text == reference.complete(prompt, 6)
