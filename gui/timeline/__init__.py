"""The pipeline timeline: one lane per device, one box per compute / transfer / wait, drawn in
batches (``TimelineView``), fed from worker threads through the ``EventBridge``."""

from gui.timeline.view import TimelineView

__all__ = ["TimelineView"]
