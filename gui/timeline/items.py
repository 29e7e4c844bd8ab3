"""The timeline's boxes: what an event kind and phase look like, and ``TimelineBoxesItem``, one
graphics item that draws all of a timeline's boxes.

Drawing is batched (ARCHITECTURE.md, Concurrency): events are appended to numpy columns, and
each ``TimelineBoxesItem`` draws ALL its boxes in one ``paint`` with one
``QPainter.drawRects`` call per style (kind x phase x colour), fed straight from numpy through
pyqtgraph's ``PrimitiveArray`` and limited to the visible time range — never one graphics
item or one ``setData`` per event, which is what keeps 100k boxes pannable and a 2,000
events/s stream cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyqtgraph as pg
from pyqtgraph.Qt.internals import PrimitiveArray
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPen

from agents.protocol import TimelineEvent

KINDS = ("compute", "send", "recv_wait", "io", "failure", "replan", "reload", "draft", "rollback")
RECOVERY_COLOURS = {"failure": "#d62728", "replan": "#7f7f7f", "reload": "#17becf"}
"""A recovery's boxes (the whole lane's height), set apart from the micro-batch colours."""
MARK_COLOURS = {**RECOVERY_COLOURS, "draft": "#9467bd", "rollback": "#e15759"}
"""Boxes of their own colour: a recovery's, and speculative decoding's (gui.techniques.speculative)."""
PHASES = ("prefill", "decode")
EVENT_WHAT = {"compute": "compute", "send": "transfer", "recv_wait": "waiting for input", "io": "storage",
              "failure": "device lost (from its last work to its detection)", "replan": "re-planning over the survivors",
              "reload": "loading the re-planned shard", "draft": "the draft proposing a trip's tokens",
              "rollback": "KV cache rolled back past rejected proposals"}
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}

MICRO_BATCH_COLOURS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1",
    "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac",
)
"""Tableau 10: distinct on light and dark backgrounds."""


# Vertical bands inside a lane of height 1 (lane i spans [i, i+1), y grows downwards).
BANDS = {0: (0.10, 0.62), 1: (0.66, 0.90), 2: (0.10, 0.62), 3: (0.10, 0.62), 4: (0.04, 0.96), 5: (0.04, 0.96),
         6: (0.04, 0.96), 7: (0.10, 0.62), 8: (0.04, 0.96)}

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
            elif KINDS[kind] in MARK_COLOURS:
                colour = QColor(MARK_COLOURS[KINDS[kind]])
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

