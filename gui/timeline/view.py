"""The pipeline timeline: one lane per device, one box per compute / transfer / wait.

Drawing is batched (ARCHITECTURE.md, Concurrency): events are appended to numpy columns,
and applied to the plot on a ~30 Hz timer. Each ``TimelineBoxesItem`` draws ALL its boxes
in one ``paint`` with one ``QPainter.drawRects`` call per style (kind x phase x colour),
fed straight from numpy through pyqtgraph's ``PrimitiveArray`` and limited to the visible
time range — never one graphics item or one ``setData`` per event, which is what keeps
100k boxes pannable and a 2,000 events/s stream cheap.

Encoding: colour = micro-batch; prefill = the colour, hatched; decode = the colour, plain;
a transfer (``send``) is a thinner box in the lower band of the sender's lane; a
``recv_wait`` is drawn faintly behind compute. Compute boxes that overlap on one lane (a decode
agent's continuous batch: one box per request, all running at once) are stacked in sub-lanes,
a lane's compute band split in as many rows as it ever ran at once. A second plot below shows the predicted
timeline (the simulator's ``TimelineEvent``s for the same plan) on the same time axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pyqtgraph as pg
from pyqtgraph.Qt.internals import PrimitiveArray
from PySide6.QtCore import QEvent, QLineF, QPointF, QRect, QRectF, Qt, QTimer, Signal
from PySide6.QtGui import QBrush, QColor, QCursor, QFontMetrics, QPainter, QPalette, QPen
from PySide6.QtWidgets import (QCheckBox, QComboBox, QGridLayout, QLabel, QPushButton, QToolTip,
                               QVBoxLayout, QWidget)

from agents.protocol import TimelineEvent
from gui.widgets import say_why_disabled

KINDS = ("compute", "send", "recv_wait", "io", "failure", "replan", "reload")
RECOVERY_COLOURS = {"failure": "#d62728", "replan": "#7f7f7f", "reload": "#17becf"}
"""A recovery's boxes (the whole lane's height), set apart from the micro-batch colours."""
PHASES = ("prefill", "decode")
EVENT_WHAT = {"compute": "compute", "send": "transfer", "recv_wait": "waiting for input", "io": "storage",
              "failure": "device lost (from its last work to its detection)", "replan": "re-planning over the survivors",
              "reload": "loading the re-planned shard"}
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}

MICRO_BATCH_COLOURS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1",
    "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac",
)
"""Tableau 10: distinct on light and dark backgrounds."""

LEGEND_TERMS = (("▨", "prefill"), ("■", "decode"), ("<span style='color:gray'>■</span>", "waiting"))
"""The legend's entries after the micro-batch colours: (symbol as rich text, words)."""
LEGEND_TOOLTIP = "Colour = micro-batch; hatched = prefill; thin lower box = transfer; grey = waiting for input"
LEGEND_CHIPS = 6
LANE_AXIS_MIN_WIDTH = 40
LANE_AXIS_MAX_WIDTH = 240
"""The lane-label column is as wide as its longest label plus LANE_AXIS_MARGIN (tick and gap), within these."""
LANE_AXIS_MARGIN = 16
"""Micro-batch colours named one by one up to this many; more are one row of chips and a range."""

# Vertical bands inside a lane of height 1 (lane i spans [i, i+1), y grows downwards).
BANDS = {0: (0.10, 0.62), 1: (0.66, 0.90), 2: (0.10, 0.62), 3: (0.10, 0.62), 4: (0.04, 0.96), 5: (0.04, 0.96),
         6: (0.04, 0.96)}

BOX_DTYPE = np.dtype([("lane", "i4"), ("stage", "i4"), ("kind", "i1"), ("phase", "i1"), ("micro_batch", "i4"),
                      ("step", "i4"), ("start_s", "f8"), ("end_s", "f8"), ("nbytes", "i8")])


class _Columns:
    """Growable numpy columns (capacity doubles, appends are amortised O(1))."""

    def __init__(self, dtype: np.dtype, capacity: int = 1024):
        self._data = np.zeros(capacity, dtype=dtype)
        self.size = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.size + len(rows)
        if need > len(self._data):
            grown = np.zeros(max(need, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size:need] = rows
        self.size = need

    @property
    def rows(self) -> np.ndarray:
        return self._data[: self.size]

    def clear(self) -> None:
        self.size = 0


class _Group:
    """The boxes of one style as contiguous columns (fast to slice and transform per frame)."""

    def __init__(self) -> None:
        self.x0 = np.empty(256)
        self.x1 = np.empty(256)
        self.lane = np.empty(256, dtype=np.int64)
        self.slot = np.empty(256, dtype=np.int64)
        self.size = 0
        self.min_x0 = np.inf
        self.max_x1 = -np.inf

    def extend(self, x0: np.ndarray, x1: np.ndarray, lane: np.ndarray, slot: np.ndarray) -> None:
        need = self.size + len(x0)
        if need > len(self.x0):
            cap = max(need, 2 * len(self.x0))
            for name in ("x0", "x1", "lane", "slot"):
                old = getattr(self, name)
                grown = np.empty(cap, dtype=old.dtype)
                grown[: self.size] = old[: self.size]
                setattr(self, name, grown)
        self.x0[self.size:need] = x0
        self.x1[self.size:need] = x1
        self.lane[self.size:need] = lane
        self.slot[self.size:need] = slot
        self.size = need
        self.min_x0 = min(self.min_x0, float(x0.min()))
        self.max_x1 = max(self.max_x1, float(x1.max()))

    def visible(self, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = self.size
        x0, x1, lane, slot = self.x0[:n], self.x1[:n], self.lane[:n], self.slot[:n]
        if self.min_x0 >= lo and self.max_x1 <= hi:
            return x0, x1, lane, slot  # all of it: no mask, no copy
        mask = (x1 >= lo) & (x0 <= hi)
        return x0[mask], x1[mask], lane[mask], slot[mask]


@dataclass(frozen=True)
class _Style:
    brush: QBrush
    hatch: QBrush | None


def _pixel_runs(spans, n_rows: int, lo: int, width: int):
    """Level of detail for a zoomed-out view: what each device pixel shows, as runs.

    ``spans`` is, in drawing order, one ``(rows, X0, X1)`` per style: the box's row
    (lane x band) and its device-pixel columns ``[X0, X1)``. Later styles overwrite
    earlier ones in a (rows x width) "winner" bitmap, exactly as painting them one over
    the other would; each run of equal winners in a row becomes one rect. So every pixel
    is filled once, however many boxes overlap it: the cost is O(pixels covered), not
    O(boxes x overdraw). Returns (style index, row, X0, X1) arrays.
    """
    win = np.full((n_rows, width + 2), -1, dtype=np.int32)
    for style_idx, (rows, X0, X1) in enumerate(spans):
        lengths = X1 - X0
        total = int(lengths.sum())
        if total == 0:
            continue
        # expand each box to its columns: repeat the start, add 0..len-1
        starts = np.repeat(X0 - lo + 1, lengths)
        offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        win[np.repeat(rows, lengths), starts + offsets] = style_idx
    r, c = np.nonzero(win[:, 1:] != win[:, :-1])  # boundaries, row-major
    same_row = r[:-1] == r[1:]
    seg_r, seg_start, seg_end = r[:-1][same_row], c[:-1][same_row], c[1:][same_row]
    value = win[seg_r, seg_start + 1]
    keep = value >= 0
    return value[keep], seg_r[keep], seg_start[keep] + lo, seg_end[keep] + lo


class TimelineBoxesItem(pg.GraphicsObject):
    """All boxes of one timeline (measured or predicted), drawn in one pass per style."""

    AGGREGATE_ABOVE = 3000
    """Visible boxes per style beyond which sub-pixel boxes are merged per pixel column."""
    BRIDGE_PX = 2
    """Zoomed out, a gap this narrow (device pixels) between boxes of one row is filled."""

    def __init__(self, ghost: bool = False) -> None:
        super().__init__()
        self.ghost = ghost
        """Drawn as faint outlined boxes under the measured ones (the prediction)."""
        self.boxes = _Columns(BOX_DTYPE)
        self.slots = _Columns(np.dtype(np.int64))
        """Per box (in ``boxes`` order): its sub-lane in its lane's compute band (0 for other kinds)."""
        self._slot_ends: dict[int, list[float]] = {}
        """Per lane: the end of the last compute box in each sub-lane (greedy interval packing)."""
        self.events: list[TimelineEvent] = []
        self._groups: dict[tuple[int, int, int], _Group] = {}
        self._rects = PrimitiveArray(QRectF, 4)
        self._bounds = QRectF(0, 0, 1, 1)
        self._max_end = 0.0
        self._lane_count = 1
        self._outline_pen = QPen(QColor(0, 0, 0, 110))
        self._outline_pen.setCosmetic(True)
        if ghost:
            self._outline_pen.setStyle(Qt.PenStyle.DashLine)
        self._hatch_colour = QColor(0, 0, 0, 120)
        self._styles: dict[tuple[int, int, int], _Style] = {}
        self.painted_boxes = 0
        """How many boxes the last paint drew (tests and the benchmark read it)."""
        self.painted_per_lane: dict[int, int] = {}
        self.painted_rects = 0

    # -- data ----------------------------------------------------------------------------
    OVERLAP_TOLERANCE = 0.25
    """A compute box overlapping a sub-lane's last box by at most this share of its own length
    still goes in that sub-lane (clock mapping jitter between consecutive boxes is no batch)."""

    def _assign_slots(self, rows: np.ndarray) -> np.ndarray:
        """Each compute box's sub-lane: the first one of its lane whose last box ends by its start
        (in arrival order, so replay assigns as the live run did); other kinds sit in sub-lane 0."""
        slot = np.zeros(len(rows), dtype=np.int64)
        comp = np.nonzero(rows["kind"] == KIND_CODE["compute"])[0]
        if not len(comp):
            return slot
        if self._one_after_another(rows[comp]):
            return slot
        for i in comp.tolist():
            start, end = float(rows["start_s"][i]), float(rows["end_s"][i])
            ends = self._slot_ends.setdefault(int(rows["lane"][i]), [])
            tol = self.OVERLAP_TOLERANCE * (end - start)
            k = next((k for k, e in enumerate(ends) if e <= start + tol), len(ends))
            if k == len(ends):
                ends.append(end)
            else:
                ends[k] = max(ends[k], end)
            slot[i] = k
        return slot

    def _one_after_another(self, comp: np.ndarray) -> bool:
        """The common case, vectorised (a pipeline's stream, 100k boxes on replay): on every lane
        these compute boxes follow each other and the lane's one sub-lane. Then their sub-lane is
        0, the lanes' ends are moved on and True is returned; otherwise nothing changes."""
        lane, start, end = comp["lane"].astype(np.int64), comp["start_s"], comp["end_s"]
        order = np.argsort(lane, kind="stable")
        lane, start, end = lane[order], start[order], end[order]
        reach = start + self.OVERLAP_TOLERANCE * (end - start)
        same = lane[1:] == lane[:-1]
        if not np.all(~same | (reach[1:] >= end[:-1])):
            return False
        first = np.concatenate(([True], ~same))
        last = np.concatenate((~same, [True]))
        for ln, r in zip(lane[first].tolist(), reach[first].tolist()):
            ends = self._slot_ends.get(ln, [])
            if len(ends) > 1 or (ends and r < ends[0]):
                return False
        for ln, e in zip(lane[last].tolist(), end[last].tolist()):
            ends = self._slot_ends.setdefault(ln, [])
            ends[:] = [max(ends[0], e)] if ends else [e]
        return True

    def lane_slots(self, lane: int) -> int:
        """How many compute boxes lane ``lane`` ran at once (at least 1): its sub-lane count."""
        return max(1, len(self._slot_ends.get(lane, ())))

    def add(self, rows: np.ndarray, events: Sequence[TimelineEvent]) -> None:
        if not len(rows):
            return
        slot = self._assign_slots(rows)
        self.boxes.extend(rows)
        self.slots.extend(slot)
        self.events.extend(events)
        colour = rows["micro_batch"] % len(MICRO_BATCH_COLOURS)
        keys = rows["kind"].astype(np.int64) * 1000 + rows["phase"].astype(np.int64) * 100 + colour
        for key in np.unique(keys):
            mask = keys == key
            sel = rows[mask]
            group_key = (int(key // 1000), int(key // 100 % 10), int(key % 100))
            group = self._groups.get(group_key)
            if group is None:
                group = self._groups[group_key] = _Group()
            group.extend(sel["start_s"], sel["end_s"], sel["lane"], slot[mask])
        self._update_bounds()

    def clear(self) -> None:
        self.boxes.clear()
        self.slots.clear()
        self._slot_ends.clear()
        self.events.clear()
        self._groups.clear()
        self._update_bounds()

    def set_lane_count(self, n: int) -> None:
        self._lane_count = max(1, n)
        self._update_bounds()

    def set_dark(self, dark: bool) -> None:
        self._outline_pen.setColor(QColor(255, 255, 255, 120) if dark else QColor(0, 0, 0, 110))
        self._hatch_colour = QColor(255, 255, 255, 150) if dark else QColor(0, 0, 0, 120)
        self._styles.clear()
        self.update()

    def max_end(self) -> float:
        return self._max_end

    def _update_bounds(self) -> None:
        self.prepareGeometryChange()
        self._max_end = float(self.boxes.rows["end_s"].max()) if self.boxes.size else 0.0
        self._bounds = QRectF(0.0, 0.0, max(self._max_end, 1e-3), float(self._lane_count))
        self.update()

    def _style(self, key: tuple[int, int, int]) -> _Style:
        style = self._styles.get(key)
        if style is None:
            kind, phase, colour_idx = key
            colour = QColor(MICRO_BATCH_COLOURS[colour_idx])
            if kind == KIND_CODE["recv_wait"]:
                colour = QColor(128, 128, 128, 25 if self.ghost else 55)
            elif KINDS[kind] in RECOVERY_COLOURS:
                colour = QColor(RECOVERY_COLOURS[KINDS[kind]])
                colour.setAlpha(170)
            elif self.ghost:
                colour.setAlpha(45)
            elif kind in (KIND_CODE["send"], KIND_CODE["io"]):
                colour.setAlpha(150)
            hatch = None
            if phase == PHASE_CODE["prefill"] and kind != KIND_CODE["recv_wait"] and not self.ghost:
                hatch = QBrush(self._hatch_colour, Qt.BrushStyle.BDiagPattern)
            style = self._styles[key] = _Style(QBrush(colour), hatch)
        return style

    # -- QGraphicsItem -------------------------------------------------------------------
    def boundingRect(self) -> QRectF:
        return QRectF(self._bounds)

    def paint(self, painter, option, widget=None) -> None:
        vb = self.getViewBox()
        if vb is None:
            return
        (xmin, xmax), _ = vb.viewRange()
        tr = painter.transform()
        sx, dx, sy, dy = tr.m11(), tr.dx(), tr.m22(), tr.dy()
        self.painted_boxes = self.painted_rects = 0
        self.painted_per_lane = {}
        if sx <= 0 or sy == 0:
            return
        slack = 1.0 / sx  # one device pixel, in seconds
        # recv_wait first (behind), then compute, then transfers.
        order = sorted(self._groups, key=lambda k: (k[0] != KIND_CODE["recv_wait"], k))
        n_lanes = self._lane_count + 1
        n_slots = max([1] + [len(e) for e in self._slot_ends.values()])
        lane_slots = np.ones(max([n_lanes] + [k + 1 for k in self._slot_ends]), dtype=np.int64)
        for k, ends in self._slot_ends.items():
            lane_slots[k] = max(1, len(ends))
        left = int(np.floor(xmin * sx + dx)) - 2
        right = int(np.ceil(xmax * sx + dx)) + 2
        styles, spans = [], []
        per_lane = np.zeros(n_lanes, dtype=np.int64)
        for key in order:
            x0, x1, lane, slot = self._groups[key].visible(xmin - slack, xmax + slack)
            if not len(x0):
                continue
            X0 = np.floor(np.clip(x0 * sx + dx, left, right)).astype(np.int64)
            X1 = np.ceil(np.clip(x1 * sx + dx, left, right)).astype(np.int64)
            X1 = np.maximum(X1, X0 + 1)  # at least one pixel wide, so a short box is still seen
            styles.append(key)
            row = (lane * 2 + (1 if key[0] == KIND_CODE["send"] else 0)) * n_slots + slot
            spans.append((row, X0, X1))
            per_lane += np.bincount(lane, minlength=n_lanes)
            self.painted_boxes += len(x0)
        self.painted_per_lane = {i: int(c) for i, c in enumerate(per_lane.tolist()) if c}
        if not styles:
            return
        widths = np.concatenate([X1 - X0 for _, X0, X1 in spans])
        # Zoomed out, boxes of a pixel or two with pixel gaps between them read as a barcode:
        # merge them per pixel column and bridge gaps of up to BRIDGE_PX, a density band.
        aggregate = (self.painted_boxes > self.AGGREGATE_ABOVE
                     or (len(widths) > 50 and float(np.median(widths)) <= 2.0))
        if aggregate:
            spans = [(row, X0, np.minimum(X1 + self.BRIDGE_PX, right)) for row, X0, X1 in spans]
            which, rows, X0s, X1s = _pixel_runs(spans, 2 * n_lanes * n_slots, left, right - left + 1)
            by_style = np.argsort(which, kind="stable")
            bounds = np.searchsorted(which[by_style], np.arange(len(styles) + 1))
            spans = [(rows[by_style[a:b]], X0s[by_style[a:b]], X1s[by_style[a:b]])
                     for a, b in zip(bounds[:-1], bounds[1:])]
        outline = not aggregate and (self.ghost or self.painted_boxes < 1000)  # a second pass only for few boxes
        # Draw in device pixels with an identity transform: integer, axis-aligned rects
        # take the raster engine's fast fill path (no scaled-path rasterisation, no AA).
        painter.save()
        painter.resetTransform()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        painter.setPen(Qt.PenStyle.NoPen)
        for key, (row, X0, X1) in zip(styles, spans):
            m = len(X0)
            if not m:
                continue
            band0, band1 = BANDS[key[0]]
            lane = row // (2 * n_slots)
            if key[0] == KIND_CODE["compute"]:  # its sub-lane's share of the compute band
                share = (band1 - band0) / lane_slots[lane]
                sub0 = band0 + share * (row % n_slots)
                sub1 = sub0 + share * (0.85 if n_slots > 1 else 1.0)
            else:
                sub0, sub1 = band0, band1
            ya = (lane + sub0) * sy + dy
            yb = (lane + sub1) * sy + dy
            top = np.round(np.minimum(ya, yb))
            self._rects.resize(m)
            arr = self._rects.ndarray()
            arr[:, 0] = X0
            arr[:, 1] = top
            arr[:, 2] = X1 - X0
            arr[:, 3] = np.round(np.maximum(ya, yb)) - top
            style = self._style(key)
            painter.setBrush(style.brush)
            painter.drawRects(*self._rects.drawargs())
            if style.hatch is not None:
                painter.setBrush(style.hatch)
                painter.drawRects(*self._rects.drawargs())
            if outline and key[0] != KIND_CODE["recv_wait"]:
                painter.setBrush(Qt.BrushStyle.NoBrush)
                painter.setPen(self._outline_pen)
                painter.drawRects(*self._rects.drawargs())
                painter.setPen(Qt.PenStyle.NoPen)
            self.painted_rects += m
        painter.restore()

    # -- hit testing -----------------------------------------------------------------------
    def box_at(self, x: float, y: float, tolerance_x: float = 0.0) -> TimelineEvent | None:
        """The event under a point in data coordinates (compute/send before recv_wait)."""
        idx = self.index_at(x, y, tolerance_x)
        return None if idx is None else self.events[idx]

    def index_at(self, x: float, y: float, tolerance_x: float = 0.0) -> int | None:
        """The row index of the box under a point (compute/send before recv_wait)."""
        rows = self.boxes.rows
        if not len(rows):
            return None
        lane = int(np.floor(y))
        frac = y - lane
        candidates = np.nonzero((rows["lane"] == lane) & (rows["start_s"] <= x + tolerance_x)
                                & (rows["end_s"] >= x - tolerance_x))[0]
        best = None
        slots = self.slots.rows
        for idx in candidates.tolist():
            band0, band1 = BANDS[int(rows["kind"][idx])]
            if rows["kind"][idx] == KIND_CODE["compute"]:
                share = (band1 - band0) / self.lane_slots(lane)
                band0 += share * int(slots[idx])
                band1 = band0 + share
            if not band0 <= frac <= band1:
                continue
            if best is None or rows["kind"][best] == KIND_CODE["recv_wait"]:
                best = idx
        return best


def describe_event(event: TimelineEvent) -> str:
    """The hover text of one box: what, where, when, how much."""
    ms = lambda s: f"{s * 1000:.2f} ms"  # noqa: E731
    what = EVENT_WHAT[event.kind]
    lines = [f"{event.device} · stage {event.stage} · {what}",
             f"{event.phase}, step {event.step}, micro-batch {event.micro_batch}",
             f"start {ms(event.start_s)}, end {ms(event.end_s)}, duration {ms(event.duration_s)}"]
    if event.kind == "send":
        rate = event.nbytes / event.duration_s if event.duration_s > 0 else 0.0  # bytes/s
        lines.append(f"{_fmt_bytes(event.nbytes)} to {event.peer or '?'} ({_fmt_rate(rate)})")
    elif event.kind == "io":
        lines.append(f"{event.peer or 'storage read'}" + (f", {_fmt_bytes(event.nbytes)}" if event.nbytes else ""))
    elif event.nbytes:
        lines.append(_fmt_bytes(event.nbytes))
    if event.clock_uncertainty_s:
        lines.append(f"clock uncertainty ±{ms(event.clock_uncertainty_s)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class RangeSummary:
    """Summed figures of the boxes inside a time range (clipped to it)."""

    x0: float
    x1: float
    boxes: int
    compute_s: dict[str, float]
    """Device -> compute time inside the range."""
    wait_s: dict[str, float]
    sent_bytes: int

    def describe(self) -> str:
        span = self.x1 - self.x0
        busy = ", ".join(f"{d} {c / span * 100:.0f} % busy" for d, c in self.compute_s.items()) if span > 0 else ""
        wait = sum(self.wait_s.values())
        return (f"Range {self.x0 * 1000:.2f}–{self.x1 * 1000:.2f} ms ({span * 1000:.2f} ms): {self.boxes} boxes; "
                f"{busy}; waiting {wait * 1000:.2f} ms; sent {_fmt_bytes(self.sent_bytes)}")


def summarise_range(rows: np.ndarray, lanes: Sequence[str], x0: float, x1: float) -> RangeSummary:
    """Sum the boxes overlapping [x0, x1], each clipped to the range (a pure function of the rows)."""
    x0, x1 = min(x0, x1), max(x0, x1)
    inside = rows[(rows["end_s"] > x0) & (rows["start_s"] < x1)]
    clipped = np.minimum(inside["end_s"], x1) - np.maximum(inside["start_s"], x0)
    compute, wait = {}, {}
    for code, out in ((KIND_CODE["compute"], compute), (KIND_CODE["recv_wait"], wait)):
        sel = inside["kind"] == code
        sums = np.bincount(inside["lane"][sel], weights=clipped[sel], minlength=len(lanes))
        for lane, total in enumerate(sums.tolist()):
            if lane < len(lanes) and (total > 0 or code == KIND_CODE["compute"]):
                out[lanes[lane]] = total
    sends = inside[inside["kind"] == KIND_CODE["send"]]
    return RangeSummary(x0=x0, x1=x1, boxes=len(inside), compute_s=compute, wait_s=wait,
                        sent_bytes=int(sends["nbytes"].sum()))


def _keys(rows: np.ndarray) -> np.ndarray:
    return (rows["lane"].astype(np.int64) << 42) | (rows["micro_batch"].astype(np.int64) << 21) | rows["step"]


def stage_errors(predicted: np.ndarray, measured: np.ndarray) -> dict[int, float]:
    """Lane -> error of the prediction in % ((measured - predicted) / predicted compute time).

    Only the (lane, micro-batch, step) computations present in both are compared, so a live
    run that is half done, or a prediction of the first steps only, is compared like for like.
    """
    pc = predicted[predicted["kind"] == KIND_CODE["compute"]]
    mc = measured[measured["kind"] == KIND_CODE["compute"]]
    if not len(pc) or not len(mc):
        return {}
    pk, mk = _keys(pc), _keys(mc)
    pc, mc = pc[np.isin(pk, mk)], mc[np.isin(mk, pk)]
    lanes = int(max(pc["lane"].max(initial=-1), mc["lane"].max(initial=-1))) + 1
    p = np.bincount(pc["lane"], weights=pc["end_s"] - pc["start_s"], minlength=lanes)
    m = np.bincount(mc["lane"], weights=mc["end_s"] - mc["start_s"], minlength=lanes)
    return {lane: float((m[lane] - p[lane]) / p[lane] * 100) for lane in range(lanes) if p[lane] > 0 and m[lane] > 0}


def flow_segments(rows: np.ndarray, micro_batch: int, step: int) -> np.ndarray:
    """Arrows (x0, lane0, x1, lane1) following one micro-batch's one step from stage to stage.

    Each compute box of the micro-batch at ``step`` points to the next stage's compute of the
    same step, and the last stage's points to the first stage's compute of the next step (the
    token going back to the source). Only the selected step: a sequential run has one
    micro-batch, and every step's arrows at once would be a mesh.
    """
    c = rows[(rows["kind"] == KIND_CODE["compute"]) & (rows["micro_batch"] == micro_batch)
             & ((rows["step"] == step) | (rows["step"] == step + 1))]
    if len(c) < 2:
        return np.zeros((0, 4))
    c = np.sort(c, order=["step", "stage", "start_s"])
    nxt = c[1:]
    cur = c[:-1]
    follows = ((nxt["step"] == cur["step"]) & (nxt["stage"] == cur["stage"] + 1)) | \
              ((nxt["step"] == cur["step"] + 1) & (nxt["stage"] == 0) & (cur["stage"] == c["stage"].max()))
    follows &= cur["step"] == step
    cur, nxt = cur[follows], nxt[follows]
    return np.column_stack([cur["end_s"], cur["lane"] + 0.36, nxt["start_s"], nxt["lane"] + 0.36])


class TimelineOverlayItem(pg.GraphicsObject):
    """Selection, highlight, flow arrows and the selected range: one item, one pass per kind.

    Fed whole arrays (never one item per box), like ``TimelineBoxesItem``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.highlight = np.zeros(0, dtype=BOX_DTYPE)
        self.selected = np.zeros(0, dtype=BOX_DTYPE)
        self.flows = np.zeros((0, 4))
        self.range: tuple[float, float] | None = None
        self._colour = QColor("#111111")
        self._bounds = QRectF(0, 0, 1, 1)
        self._rects = PrimitiveArray(QRectF, 4)
        self.setZValue(10)

    def set_colour(self, colour: QColor) -> None:
        self._colour = QColor(colour)
        self.update()

    def set_data(self, highlight: np.ndarray, selected: np.ndarray, flows: np.ndarray,
                 range_: tuple[float, float] | None, bounds: QRectF) -> None:
        self.prepareGeometryChange()
        self.highlight, self.selected, self.flows, self.range = highlight, selected, flows, range_
        self._bounds = QRectF(bounds)
        self.update()

    def boundingRect(self) -> QRectF:
        return QRectF(self._bounds)

    def _device_rects(self, rows: np.ndarray, sx, dx, sy, dy) -> None:
        b0 = np.array([BANDS[k][0] for k in range(len(KINDS))])[rows["kind"]]
        b1 = np.array([BANDS[k][1] for k in range(len(KINDS))])[rows["kind"]]
        X0 = np.floor(rows["start_s"] * sx + dx)
        X1 = np.maximum(np.ceil(rows["end_s"] * sx + dx), X0 + 1)
        ya, yb = (rows["lane"] + b0) * sy + dy, (rows["lane"] + b1) * sy + dy
        self._rects.resize(len(rows))
        arr = self._rects.ndarray()
        arr[:, 0], arr[:, 1] = X0, np.round(np.minimum(ya, yb))
        arr[:, 2], arr[:, 3] = X1 - X0, np.round(np.abs(yb - ya))

    def paint(self, painter, option, widget=None) -> None:
        tr = painter.transform()
        sx, dx, sy, dy = tr.m11(), tr.dx(), tr.m22(), tr.dy()
        if sx <= 0:
            return
        painter.save()
        painter.resetTransform()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        if self.range is not None:
            shade = QColor(self._colour)
            shade.setAlpha(40)
            x0, x1 = (v * sx + dx for v in self.range)
            painter.fillRect(QRectF(x0, -1e5, x1 - x0, 2e5), shade)
        for rows, width in ((self.highlight, 1.5), (self.selected, 3.0)):
            if not len(rows):
                continue
            self._device_rects(rows, sx, dx, sy, dy)
            pen = QPen(self._colour, width)
            pen.setCosmetic(True)
            painter.setPen(pen)
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRects(*self._rects.drawargs())
        if len(self.flows):
            x0 = self.flows[:, 0] * sx + dx
            y0 = self.flows[:, 1] * sy + dy
            x1 = self.flows[:, 2] * sx + dx
            y1 = self.flows[:, 3] * sy + dy
            ang = np.arctan2(y1 - y0, x1 - x0)
            head = 7.0
            lines = np.column_stack([
                np.concatenate([x0, x1, x1]), np.concatenate([y0, y1, y1]),
                np.concatenate([x1, x1 - head * np.cos(ang - 0.45), x1 - head * np.cos(ang + 0.45)]),
                np.concatenate([y1, y1 - head * np.sin(ang - 0.45), y1 - head * np.sin(ang + 0.45)])])
            arr = PrimitiveArray(QLineF, 4)
            arr.resize(len(lines))
            arr.ndarray()[:] = lines
            pen = QPen(self._colour, 1.6)
            pen.setCosmetic(True)
            painter.setPen(pen)
            painter.drawLines(*arr.drawargs())
        painter.restore()


class _TimelineViewBox(pg.ViewBox):
    """Shift + drag selects a time range (its summed figures); plain drag pans as before."""

    def __init__(self, on_range) -> None:
        super().__init__()
        self._on_range = on_range
        self._range_start: float | None = None

    def mouseDragEvent(self, ev, axis=None) -> None:
        if ev.button() == Qt.MouseButton.LeftButton and ev.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            ev.accept()
            x = self.mapSceneToView(ev.scenePos()).x()
            if ev.isStart() or self._range_start is None:
                self._range_start = self.mapSceneToView(ev.buttonDownScenePos()).x()
            self._on_range(self._range_start, x, ev.isFinish())
            if ev.isFinish():
                self._range_start = None
            return
        super().mouseDragEvent(ev, axis)


def _plain(rich: str) -> str:
    """A legend's rich text as the words it shows."""
    return re.sub(r"<[^>]+>", "", rich).replace("&nbsp;", " ")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_rate(bytes_per_s: float) -> str:
    """A transfer rate that reads: 16 B in 2 ms is "8.0 kB/s", not "0.0 MB/s"."""
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


class TimelineView(QWidget):
    """Measured (and optionally predicted) pipeline timeline with zoom, pan and follow-live.

    Feed it with ``append_events`` from the GUI thread (the ``EventBridge`` batches what
    worker threads produce); boxes appear at the next ~30 Hz frame.
    """

    follow_live_changed = Signal(bool)
    predicted_visibility_changed = Signal(bool)
    selection_changed = Signal(object)
    """The selected ``TimelineEvent`` (None when nothing is)."""

    HINT = ("Click a box for its details · Shift+drag to sum a range · W/S zoom, A/D pan, "
            "Ctrl+wheel zoom, F fit")

    def __init__(self, parent: QWidget | None = None, frame_rate_hz: float = 30.0):
        super().__init__(parent)
        self.setAccessibleName("Pipeline timeline")
        self.setAccessibleDescription("W/S, +/- or Ctrl+wheel to zoom, A/D, arrows or drag to pan, F to fit")
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self._lanes: list[str] = []
        self._lane_of: dict[str, int] = {}
        self._lane_notes: dict[str, str] = {}
        """Device -> its role in the run, shown after its name (attention offloading: compute
        replica / attention)."""
        self._pending: list[TimelineEvent] = []
        self._micro_batches: set[int] = set()
        self._follow_live = True
        self._setting_range = False

        self.follow_check = QCheckBox("Follow live")
        self.follow_check.setChecked(True)
        self.follow_check.setAccessibleName("Follow live")
        self.follow_check.setToolTip("Keep the newest events in view (turned off when you pan or zoom)")
        self.follow_check.toggled.connect(self._on_follow_check_toggled)
        self.predicted_check = QCheckBox("Show predicted")
        self.predicted_check.setAccessibleName("Show predicted timeline")
        self.predicted_check.setToolTip("Draw the simulator's prediction for the same plan as ghost boxes "
                                        "under the measured ones, with each stage's error in %")
        self.predicted_check.setEnabled(False)
        say_why_disabled({self.predicted_check: "no prediction for this run: it needs the plan's profile"})
        self.predicted_check.toggled.connect(self._on_predicted_check_toggled)
        self.fit_button = QPushButton("Fit")
        self.fit_button.setAccessibleName("Fit timeline")
        self.fit_button.setToolTip("Zoom to show the whole run (F)")
        self.fit_button.setShortcut("F")
        self.fit_button.clicked.connect(self.fit_all)
        self.legend_label = QLabel()
        self.legend_label.setAccessibleName("Timeline legend")
        self._legend_terms = LEGEND_TERMS
        self._legend_micro_batches = True
        self.legend_label.setToolTip(LEGEND_TOOLTIP)
        # a legend that grows with the micro-batches seen must not widen the view's minimum: in the
        # Run screen's splitter that pushed the settings pane aside when a run ended (the page jumped).
        # Where its one line does not fit, the toolbar wraps (legend on a row of its own) and the
        # legend wraps between entries (never inside one), instead of clipping its last words.
        self.legend_label.setMinimumWidth(40)
        self.legend_label.setWordWrap(True)

        self.highlight_combo = QComboBox()
        self.highlight_combo.setAccessibleName("Highlight")
        self.highlight_combo.setToolTip("Which boxes a click highlights with the selected one")
        for label, mode in (("Highlight micro-batch", "micro_batch"), ("Highlight token", "step"),
                            ("Highlight nothing", "")):
            self.highlight_combo.addItem(label, mode)
        self.highlight_combo.currentIndexChanged.connect(self._update_overlay)

        # One row where there is room, two where the view is narrow (a 1024 px screen): the
        # toolbar's minimum is the two-row one, so it never widens the Run or Sessions page.
        self.toolbar = QWidget()
        self._bar = QGridLayout(self.toolbar)
        self._bar.setContentsMargins(4, 2, 8, 2)
        self._bar.setVerticalSpacing(2)
        self._bar_wrapped: tuple[bool, bool] | None = None
        self._legend_width = 0
        self._arrange_toolbar(wrapped=True)
        self.toolbar.setMinimumWidth(self._bar.minimumSize().width())
        self._arrange_toolbar(wrapped=False)
        self._one_row_width = self._bar.minimumSize().width() - self.legend_label.minimumWidth()
        """The one-row toolbar's width without its legend (the legend's own width is added when deciding)."""
        self.details_label = QLabel(self.HINT)
        self.details_label.setAccessibleName("Selection details")
        self.details_label.setWordWrap(True)
        self.details_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # a fixed number of lines (two, three where the view is narrow): selecting a box or a
        # range never moves the plot
        self._fit_details_label(lines=2)
        self.details_label.setContentsMargins(6, 0, 6, 0)

        self.plot_widget = pg.GraphicsLayoutWidget()
        self.plot_widget.setAccessibleName("Timeline plot")
        self.plot_widget.setToolTip("")
        # keys go to the view as soon as the pointer is over the plot (no focus click first)
        self.plot_widget.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.plot_widget.viewport().installEventFilter(self)
        self.measured_plot = self.plot_widget.addPlot(row=0, col=0, viewBox=_TimelineViewBox(self._on_range_dragged))
        self.measured_item = TimelineBoxesItem()
        self.predicted_item = TimelineBoxesItem(ghost=True)
        self.predicted_item.setZValue(-1)
        self.predicted_item.setVisible(False)
        self.overlay_item = TimelineOverlayItem()
        plot = self.measured_plot
        plot.addItem(self.predicted_item)
        plot.addItem(self.measured_item)
        plot.addItem(self.overlay_item)
        plot.setMenuEnabled(False)
        plot.hideButtons()
        plot.setMouseEnabled(x=True, y=False)
        plot.invertY(True)
        plot.setLabel("bottom", "time", units="s")
        plot.showGrid(x=True, y=False, alpha=0.25)
        # major ticks only: every grid line is a full-height line redrawn on each pan
        plot.getAxis("bottom").setStyle(maxTickLevel=0)
        vb = plot.getViewBox()
        vb.disableAutoRange()
        vb.setLimits(xMin=-0.05, minXRange=1e-5)
        vb.setYRange(0, 1, padding=0.02)
        vb.sigRangeChangedManually.connect(self._on_viewbox_range_changed_manually)
        self.plot_widget.scene().sigMouseMoved.connect(self._on_scene_mouse_moved)
        self.plot_widget.scene().sigMouseClicked.connect(self._on_scene_mouse_clicked)
        self._selected: int | None = None
        self._range: tuple[float, float] | None = None
        self._hover: int | None = None
        self._errors: dict[int, float] = {}

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.toolbar)
        layout.addWidget(self.details_label)
        layout.addWidget(self.plot_widget, 1)

        self._frame_timer = QTimer(self)
        self._frame_timer.setInterval(max(1, int(1000 / frame_rate_hz)))
        self._frame_timer.timeout.connect(self._on_frame_timer_timeout)
        self._errors_timer = QTimer(self)
        self._errors_timer.setSingleShot(True)
        self._errors_timer.setInterval(500)
        self._errors_timer.timeout.connect(self._update_errors)
        self._apply_palette()
        self._update_legend()
        self._update_lane_axis()  # no lanes yet: no numeric ticks on the lane axis

    def _arrange_toolbar(self, wrapped: bool, legend_alone: bool = False) -> None:
        """Toolbar in one row, or in two (highlight and legend below) where the view is narrow, or
        in three (the legend on a row of its own) where even the second row has no room for it."""
        layout = (wrapped, legend_alone and wrapped)
        if layout == self._bar_wrapped:
            return
        self._bar_wrapped = layout
        bar = self._bar
        widgets = (self.follow_check, self.predicted_check, self.fit_button, self.highlight_combo, self.legend_label)
        for w in widgets:
            bar.removeWidget(w)
        for column in range(6):
            bar.setColumnStretch(column, 0)
        bar.addWidget(self.follow_check, 0, 0)
        bar.addWidget(self.predicted_check, 0, 1)
        bar.addWidget(self.fit_button, 0, 2)
        if wrapped:
            bar.addWidget(self.highlight_combo, 1, 0, 1, 2)
            if legend_alone:
                bar.addWidget(self.legend_label, 2, 0, 1, 6)
            else:
                bar.addWidget(self.legend_label, 1, 2, 1, 4)
            bar.setColumnStretch(5, 1)
            self.legend_label.setMinimumWidth(40)
        else:  # chosen only where the whole legend fits (``_arrange_for_width``): it gets that width
            bar.addWidget(self.highlight_combo, 0, 3)
            bar.addWidget(self.legend_label, 0, 5)
            bar.setColumnStretch(4, 1)
            self.legend_label.setMinimumWidth(max(40, self._legend_width))

    def hide_live_controls(self) -> None:
        """A recorded run shown for itself (Compare): no Follow live nor Show predicted, and the
        toolbar's one row is measured without them (else Fit sat alone on a row of its own)."""
        self.follow_check.setVisible(False)
        self.predicted_check.setVisible(False)
        self._bar_wrapped = None
        self._arrange_toolbar(wrapped=False)
        self._bar.invalidate()
        self._one_row_width = self._bar.minimumSize().width() - self.legend_label.minimumWidth()
        self._arrange_for_width(self.width())

    def _fit_details_label(self, lines: int) -> None:
        self.details_label.setFixedHeight(lines * self.details_label.fontMetrics().lineSpacing() + 6)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._arrange_for_width(event.size().width())

    def _arrange_for_width(self, width: int) -> None:
        """One toolbar row where the whole legend fits beside the controls, else two."""
        narrow = width < self._one_row_width + self._legend_width
        beside = width - self.highlight_combo.sizeHint().width() - 24  # the legend's room on the second row
        self._arrange_toolbar(wrapped=narrow, legend_alone=beside < self._legend_width)
        self.legend_label.setMinimumWidth(40 if narrow else max(40, self._legend_width))
        self._fit_details_label(lines=3 if narrow else 2)

    # -- public API ----------------------------------------------------------------------
    def set_lanes(self, devices: Sequence[str]) -> None:
        """Fix the lane order (e.g. stage order of the plan); unknown devices append later."""
        for device in devices:
            self._lane_index(device)
        self._update_lane_axis()

    def lanes(self) -> list[str]:
        return list(self._lanes)

    def set_lane_notes(self, notes: dict[str, str]) -> None:
        """Each device's role in the run, shown after its lane's name (events still go by device)."""
        self._lane_notes = dict(notes)
        self._update_lane_axis()

    def lane_labels(self) -> list[str]:
        """The lane axis's labels, top lane first."""
        return [self._lane_label(i, name) for i, name in enumerate(self._lanes)]

    def append_events(self, events: Iterable[TimelineEvent]) -> None:
        """Queue measured events; they are drawn at the next frame (~30 Hz)."""
        self._pending.extend(events)
        if self._pending and not self._frame_timer.isActive():
            self._frame_timer.start()

    def set_predicted(self, events: Sequence[TimelineEvent]) -> None:
        """Replace the predicted timeline (shown below the measured one when enabled)."""
        self.predicted_item.clear()
        for event in events:
            self._lane_index(event.device)
        self.predicted_item.add(self._rows(events), list(events))
        self._errors = stage_errors(self.predicted_item.boxes.rows, self.measured_item.boxes.rows)
        self._update_lane_axis()
        self.predicted_check.setEnabled(bool(events))
        if not events:
            self.predicted_check.setChecked(False)
        elif not self.measured_item.boxes.size:
            self.fit_all()  # before a run, show the whole prediction

    def clear(self) -> None:
        """Forget all measured and predicted boxes and lanes (a new run)."""
        self._pending.clear()
        self._frame_timer.stop()
        self.measured_item.clear()
        self.predicted_item.clear()
        self._lanes.clear()
        self._lane_of.clear()
        self._lane_notes = {}
        self._micro_batches.clear()
        self._errors = {}
        self._hover = None
        self.select(None)
        self._update_legend()
        self.predicted_check.setEnabled(False)
        self.predicted_check.setChecked(False)
        self._update_lane_axis()
        self.set_follow_live(True)
        self._set_x_range(0.0, 1.0)

    def flush(self) -> None:
        """Apply queued events now (the frame timer does this ~30 times a second)."""
        self._on_frame_timer_timeout()
        if self.predicted_item.boxes.size:
            self._update_errors()

    def box_count(self, device: str | None = None, kind: str | None = None,
                  predicted: bool = False) -> int:
        rows = (self.predicted_item if predicted else self.measured_item).boxes.rows
        mask = np.ones(len(rows), dtype=bool)
        if device is not None:
            mask &= rows["lane"] == self._lane_of.get(device, -1)
        if kind is not None:
            mask &= rows["kind"] == KIND_CODE[kind]
        return int(mask.sum())

    def boxes(self, predicted: bool = False) -> np.ndarray:
        """All boxes as a structured array in a canonical order (to compare two timelines)."""
        rows = (self.predicted_item if predicted else self.measured_item).boxes.rows.copy()
        return np.sort(rows, order=["lane", "start_s", "kind", "micro_batch", "step", "end_s"])

    def follow_live(self) -> bool:
        return self._follow_live

    def set_follow_live(self, on: bool) -> None:
        if on == self._follow_live and self.follow_check.isChecked() == on:
            return
        self._follow_live = on
        self.follow_check.blockSignals(True)
        self.follow_check.setChecked(on)
        self.follow_check.blockSignals(False)
        if on:
            self._follow()
        self.follow_live_changed.emit(on)

    def show_predicted(self, on: bool) -> None:
        self.predicted_check.setChecked(on)

    def show_whole_run(self) -> None:
        """A live run ended: if the view was following it, show all of it. Following keeps a window
        as wide as the prediction shown before the run, so the start of a longer run (its prefill)
        was left scrolled out of view; a range the operator chose is kept."""
        if self._follow_live and self.measured_item.max_end() > 0:
            self.fit_all()

    def fit_all(self) -> None:
        end = max(self.measured_item.max_end(), self.predicted_item.max_end(), 1e-3)
        self._set_x_range(0.0, end * 1.02)

    def x_range(self) -> tuple[float, float]:
        return tuple(self.measured_plot.getViewBox().viewRange()[0])

    def set_x_range(self, x0: float, x1: float) -> None:
        """Zoom/pan programmatically (like a user would: follow-live turns off)."""
        self.set_follow_live(False)
        self._set_x_range(x0, x1)

    def event_at(self, x: float, device: str, band: str = "compute",
                 predicted: bool = False) -> TimelineEvent | None:
        lane = self._lane_of.get(device)
        if lane is None:
            return None
        b0, b1 = BANDS[KIND_CODE[band]]
        item = self.predicted_item if predicted else self.measured_item
        return item.box_at(x, lane + (b0 + b1) / 2)

    def keyPressEvent(self, event) -> None:
        """Keyboard zoom and pan (as Perfetto): W / + and S / - zoom around the centre,
        A / Left and D / Right pan by a tenth; Escape clears the selection."""
        x0, x1 = self.x_range()
        width, centre = x1 - x0, (x0 + x1) / 2
        key = event.key()
        if key in (Qt.Key.Key_Plus, Qt.Key.Key_Equal, Qt.Key.Key_W):
            self.set_x_range(centre - width / 3, centre + width / 3)
        elif key in (Qt.Key.Key_Minus, Qt.Key.Key_S):
            self.set_x_range(max(0.0, centre - width * 0.75), centre + width * 0.75)
        elif key in (Qt.Key.Key_Left, Qt.Key.Key_A):
            shift = min(width / 10, x0)
            self.set_x_range(x0 - shift, x1 - shift)
        elif key in (Qt.Key.Key_Right, Qt.Key.Key_D):
            self.set_x_range(x0 + width / 10, x1 + width / 10)
        elif key == Qt.Key.Key_Escape:
            self.select(None)
        else:
            super().keyPressEvent(event)

    # -- internals -----------------------------------------------------------------------
    def _lane_index(self, device: str) -> int:
        lane = self._lane_of.get(device)
        if lane is None:
            lane = self._lane_of[device] = len(self._lanes)
            self._lanes.append(device)
        return lane

    def _rows(self, events: Sequence[TimelineEvent]) -> np.ndarray:
        rows = np.empty(len(events), dtype=BOX_DTYPE)
        if not len(events):
            return rows
        rows["lane"] = [self._lane_index(e.device) for e in events]
        rows["stage"] = [e.stage for e in events]
        rows["kind"] = [KIND_CODE[e.kind] for e in events]
        rows["phase"] = [PHASE_CODE[e.phase] for e in events]
        rows["micro_batch"] = [e.micro_batch for e in events]
        rows["step"] = [e.step for e in events]
        rows["start_s"] = [e.start_s for e in events]
        rows["end_s"] = [e.end_s for e in events]
        rows["nbytes"] = [e.nbytes for e in events]
        return rows

    def _on_frame_timer_timeout(self) -> None:
        if not self._pending:
            self._frame_timer.stop()
            return
        events, self._pending = self._pending, []
        lanes_before = len(self._lanes)
        rows = self._rows(events)
        self.measured_item.add(rows, events)
        if len(self._lanes) != lanes_before:
            self._update_lane_axis()
        new_mbs = set(np.unique(rows["micro_batch"]).tolist()) - self._micro_batches
        if new_mbs:
            self._micro_batches |= new_mbs
            self._update_legend()
        if self._follow_live:
            self._follow()
        if self.predicted_item.boxes.size and not self._errors_timer.isActive():
            self._errors_timer.start()  # at most twice a second, however fast events arrive

    def _follow(self) -> None:
        end = self.measured_item.max_end()
        if end <= 0:
            return
        x0, x1 = self.x_range()
        width = x1 - x0
        if end <= width:  # the whole run still fits: show it from the start
            self._set_x_range(0.0, max(width, end * 1.05))
        else:
            self._set_x_range(end - width * 0.95, end + width * 0.05)

    def _set_x_range(self, x0: float, x1: float) -> None:
        self._setting_range = True
        try:
            self.measured_plot.getViewBox().setXRange(x0, x1, padding=0)
        finally:
            self._setting_range = False

    def _update_lane_axis(self) -> None:
        n = max(1, len(self._lanes))
        ticks = [[(i + 0.5, self._lane_label(i, name)) for i, name in enumerate(self._lanes)], []]
        plot = self.measured_plot
        axis = plot.getAxis("left")
        axis.setTicks(ticks)
        # as wide as the longest lane label: a fixed 120 px left the boxes ~145 px of a 1024x700
        # Run screen's timeline for labels like "edge-a" (~45 px), and clipped longer ones
        metrics = QFontMetrics(axis.style["tickFont"] or axis.font())
        widest = max((metrics.horizontalAdvance(label) for _, label in ticks[0]), default=0)
        axis.setWidth(min(LANE_AXIS_MAX_WIDTH, max(LANE_AXIS_MIN_WIDTH, widest + LANE_AXIS_MARGIN)))
        for item in (self.measured_item, self.predicted_item):
            item.set_lane_count(n)
        vb = plot.getViewBox()
        vb.setLimits(yMin=-0.05, yMax=n + 0.05)
        vb.setYRange(0, n, padding=0.0)

    def _lane_label(self, lane: int, name: str) -> str:
        error = self._errors.get(lane) if self.predicted_check.isChecked() else None
        note = self._lane_notes.get(name)
        shown = name if not note else f"{name} · {note}"
        return shown if error is None else f"{shown}  {error:+.0f} %"

    def stage_errors(self) -> dict[str, float]:
        """Device -> prediction error in % of its compute time (what the lane labels show)."""
        return {self._lanes[lane]: err for lane, err in self._errors.items() if lane < len(self._lanes)}

    def _update_errors(self) -> None:
        errors = stage_errors(self.predicted_item.boxes.rows, self.measured_item.boxes.rows)
        if errors != self._errors:
            self._errors = errors
            self._update_lane_axis()

    def set_legend_terms(self, terms: Sequence[tuple[str, str]], tooltip: str, *, micro_batches: bool = True) -> None:
        """What the legend names (after the micro-batch colours unless ``micro_batches`` is off): for a
        technique whose boxes mean other things, e.g. spatial strips (compute, scatter, gather)."""
        self._legend_terms = tuple(terms)
        self._legend_micro_batches = micro_batches
        self.legend_label.setToolTip(tooltip)
        self._update_legend()

    def legend_text(self) -> str:
        """The legend as plain words (what an operator reads)."""
        return _plain(self.legend_label.text())

    def _update_legend(self) -> None:
        mbs = sorted(self._micro_batches) or [0]

        def chip(m: int) -> str:
            return f"<span style='color:{MICRO_BATCH_COLOURS[m % len(MICRO_BATCH_COLOURS)]}'>■</span>"

        if not self._legend_micro_batches:
            entries = []
        elif len(mbs) <= LEGEND_CHIPS:
            entries = [f"{chip(m)}&nbsp;mb{m}" for m in mbs]
        else:  # one entry: a chip per colour in use, then the range
            entries = ["".join(chip(m) for m in mbs[:len(MICRO_BATCH_COLOURS)]) + f"&nbsp;mb{mbs[0]}–{mbs[-1]}"]
        entries += [f"{symbol}&nbsp;{words.replace(' ', '&nbsp;')}" for symbol, words in self._legend_terms]
        # entries never break inside (non-breaking spaces); the label wraps between them
        self.legend_label.setText("&nbsp;&nbsp; ".join(entries))
        self._legend_width = self.legend_label.fontMetrics().horizontalAdvance(_plain(self.legend_label.text())) + 16
        if self._bar_wrapped is not None:
            self._arrange_for_width(self.width())

    def _on_follow_check_toggled(self, on: bool) -> None:
        self.set_follow_live(on)

    def _on_predicted_check_toggled(self, on: bool) -> None:
        self.predicted_item.setVisible(on)
        self.measured_plot.setTitle("measured, predicted as dashed ghosts (lane: prediction error)" if on
                                    else "measured", size="9pt", color=self._text_colour)
        self._update_lane_axis()
        self.predicted_visibility_changed.emit(on)

    def _on_viewbox_range_changed_manually(self, *_args) -> None:
        if not self._setting_range and self._follow_live:
            self.set_follow_live(False)

    def _item_index_at(self, scene_pos: QPointF) -> tuple[TimelineBoxesItem, int] | None:
        vb = self.measured_plot.getViewBox()
        if not vb.sceneBoundingRect().contains(scene_pos):
            return None
        p = vb.mapSceneToView(scene_pos)
        items = [self.measured_item] + ([self.predicted_item] if self.predicted_item.isVisible() else [])
        for item in items:
            idx = item.index_at(p.x(), p.y(), tolerance_x=2 * (item.pixelWidth() or 0.0))
            if idx is not None:
                return item, idx
        return None

    def _on_scene_mouse_moved(self, scene_pos: QPointF) -> None:
        hit = self._item_index_at(scene_pos)
        key = None if hit is None else (id(hit[0]), hit[1])
        if key == self._hover:
            return  # resting on the same box: the tooltip stays as it is
        self._hover = key
        if hit is None:
            QToolTip.hideText()
            return
        item, idx = hit
        text = describe_event(item.events[idx])
        if item is self.predicted_item:
            text = "predicted\n" + text
        QToolTip.showText(QCursor.pos(), text, self.plot_widget, QRect(), 60_000)

    def _on_scene_mouse_clicked(self, ev) -> None:
        if ev.button() != Qt.MouseButton.LeftButton or ev.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            return
        hit = self._item_index_at(ev.scenePos())
        if hit is None or hit[0] is not self.measured_item:
            self.select(None)
        else:
            self.select(hit[1])

    # -- selection, highlight, flows, range -------------------------------------------------
    def select(self, index: int | None) -> None:
        """Select the measured box at row ``index`` (None: clear): details, highlight, flows."""
        self._selected = index
        self._range = None
        event = None if index is None else self.measured_item.events[index]
        self.details_label.setText(self.HINT if event is None else self.selection_details(index))
        self._update_overlay()
        self.selection_changed.emit(event)

    def select_event(self, event: TimelineEvent) -> None:
        self.select(self.measured_item.events.index(event))

    def selected_event(self) -> TimelineEvent | None:
        return None if self._selected is None else self.measured_item.events[self._selected]

    def selection_details(self, index: int) -> str:
        """What the details line says about one measured box (stage, device, token, wait…)."""
        rows = self.measured_item.boxes.rows
        e = self.measured_item.events[index]
        r = rows[index]
        same = (rows["lane"] == r["lane"]) & (rows["micro_batch"] == r["micro_batch"]) & (rows["step"] == r["step"])
        wait = float((rows["end_s"] - rows["start_s"])[same & (rows["kind"] == KIND_CODE["recv_wait"])].sum())
        what = EVENT_WHAT[e.kind]
        parts = [f"Stage {e.stage} on {e.device} · {what} · micro-batch {e.micro_batch} · step {e.step} "
                 f"({e.phase}) · token {e.step}",
                 f"start {e.start_s * 1000:.2f} ms · duration {e.duration_s * 1000:.2f} ms · "
                 f"bytes {_fmt_bytes(e.nbytes)}" + (f" to {e.peer}" if e.peer else "")
                 + f" · waited {wait * 1000:.2f} ms for input"]
        return "\n".join(parts)

    def highlighted_count(self) -> int:
        return len(self.overlay_item.highlight)

    def flow_count(self) -> int:
        return len(self.overlay_item.flows)

    def select_range(self, x0: float, x1: float) -> RangeSummary:
        """Select [x0, x1] and show the summed figures of the boxes inside it."""
        summary = summarise_range(self.measured_item.boxes.rows, self._lanes, x0, x1)
        self._selected = None
        self._range = (summary.x0, summary.x1)
        self.details_label.setText(summary.describe())
        self._update_overlay()
        return summary

    def _on_range_dragged(self, x0: float, x1: float, finished: bool) -> None:
        if finished:
            self.select_range(x0, x1)
        else:
            self._range = (min(x0, x1), max(x0, x1))
            self._update_overlay()

    def _update_overlay(self, *_args) -> None:
        rows = self.measured_item.boxes.rows
        empty = rows[:0]
        highlight, selected, flows = empty, empty, np.zeros((0, 4))
        if self._selected is not None and self._selected < len(rows):
            r = rows[self._selected]
            selected = rows[self._selected:self._selected + 1]
            mode = self.highlight_combo.currentData()
            if mode:
                highlight = rows[(rows[mode] == r[mode]) & (rows["kind"] != KIND_CODE["recv_wait"])]
            flows = flow_segments(rows, int(r["micro_batch"]), int(r["step"]))
        self.overlay_item.set_data(highlight, selected, flows, self._range,
                                   self.measured_item.boundingRect())

    def eventFilter(self, obj, event) -> bool:
        if obj is self.plot_widget.viewport():
            if event.type() == QEvent.Type.Enter and not self.hasFocus():
                self.setFocus(Qt.FocusReason.MouseFocusReason)
            elif event.type() == QEvent.Type.Leave:
                self._hover = None
        return super().eventFilter(obj, event)

    # -- palette (light / dark) ----------------------------------------------------------
    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._apply_palette()
        super().changeEvent(event)

    def _apply_palette(self) -> None:
        pal = self.palette()
        base = pal.color(QPalette.ColorRole.Base)
        text = pal.color(QPalette.ColorRole.Text)
        dark = base.lightness() < 128
        self.plot_widget.setBackground(base)
        self._text_colour = text.name()
        plot = self.measured_plot
        for name in ("left", "bottom"):
            axis = plot.getAxis(name)
            axis.setPen(pg.mkPen(text))
            axis.setTextPen(pg.mkPen(text))
        # LabelItem writes its colour into the title's HTML, so re-set the text with it.
        plot.setTitle(plot.titleLabel.text or "measured", size="9pt", color=text.name())
        for item in (self.measured_item, self.predicted_item):
            item.set_dark(dark)
        self.overlay_item.set_colour(QColor("#f5f5f5") if dark else QColor("#111111"))
