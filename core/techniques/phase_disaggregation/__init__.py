"""Encode / prefill / decode disaggregation (EPD) for multimodal models: three pools of devices.

Parts: ``types`` (requests, workloads, phase costs, pool configurations, per-request metrics,
SLOs — shared by the simulator, the search and the real run). docs/phase-disaggregation.md
explains them.
"""
