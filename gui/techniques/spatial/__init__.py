"""Spatial partitioning's plan view (``plan_view``: problem sources, strategies, Compare, *Run on
agents*) and its tile canvas (``tiles``)."""

from gui.techniques.spatial.plan_view import SpatialPlanView
from gui.techniques.spatial.tiles import TileCanvas, owned_ranges, read_ranges

__all__ = ["SpatialPlanView", "TileCanvas", "owned_ranges", "read_ranges"]
