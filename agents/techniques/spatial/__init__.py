"""Spatial partitioning (EdgeMI) on agents: a CNN's feature maps cut into column strips over devices.

``network``: the generated CNNs and a strip's compute; ``session``: a run on the data plane
(gateway scatters, workers compute, gateway gathers); ``messages``: its wire; ``handlers``: how
an agent serves it. Registered as ``TECHNIQUE`` by ``agents.techniques``."""

from __future__ import annotations

from agents.profiling_protocol import ConvSweepOptions
from agents.registry import AgentTechnique, DataKind
from agents.techniques.spatial import handlers
from agents.techniques.spatial.messages import (
    STRIP_KIND,
    ClassifyImage,
    ComputeStrip,
    ImageClassified,
    SpatialSetup,
    StripComputed,
    StripRelay,
)

TECHNIQUE = AgentTechnique(
    name="spatial",
    messages=(ComputeStrip, StripComputed, SpatialSetup, ClassifyImage, ImageClassified),
    options=(StripRelay,),
    data_kinds=(DataKind(STRIP_KIND, StripRelay, required=False),),
    handlers=handlers.HANDLERS,
    profilers={ConvSweepOptions: handlers.conv_sweep},
    free_memory=handlers.free_memory,
)
