"""What is known of the devices, and the machinery that reaches them.

Public: ``cluster`` (Device, Link, Cluster), ``profile`` (Profile: per-device unit times,
links), ``discovery`` (mDNS), ``deploy`` (SSH deploy, verified host keys), ``deployments``
(what was deployed, remembered), ``testbed`` (netns devices), ``local_cluster`` (agents as
local processes), ``cpu_placement`` (a local cluster's agents and server on the host's cores),
``profiling`` (measure a Profile through the agents).
"""
