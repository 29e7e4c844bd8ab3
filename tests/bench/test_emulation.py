"""bench/emulation.py: the A/B's second cluster runs the other checkout's agents."""

from __future__ import annotations

import os

from bench.emulation import _cluster_class
from core.devices.local_cluster import LocalCluster


def test_the_second_clusters_agents_import_agents_from_the_other_checkout_first(tmp_path):
    """Setting PYTHONPATH around the cluster's start did nothing: the local cluster puts its own
    tree first in the agents' PYTHONPATH, and both clusters ran this tree's agents."""
    other = _cluster_class(str(tmp_path))
    cluster = other.__new__(other)
    cluster.threads_per_agent = 1
    assert cluster._agent_env()["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    assert _cluster_class(None) is LocalCluster
