"""Inspecting a timeline: the hover text of a box, the details of the selected one, the summed
figures of a time range, the flow of one micro-batch's token from stage to stage, and each
lane's prediction error — pure functions of the boxes' rows — and ``TimelineInspection``, the
view's hover, click, selection and range handling over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from PySide6.QtCore import QPointF, QRect, Qt
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import QToolTip

from agents.protocol import TimelineEvent
from gui.timeline.items import EVENT_WHAT, KIND_CODE, TimelineBoxesItem


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


class TimelineInspection:
    """``TimelineView``'s hover, click, selection and range (mixed into the view, which owns the
    plot, the boxes, the overlay and the details line these read and write)."""

    # -- hover and click -------------------------------------------------------------------
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

