"""The cluster: a topology graph (nodes sized by compute, links by bandwidth) and heatmaps.

Compute is the device's decode speed from the profile when there is one (tokens/s of
the whole model at batch 1), else its core count, so the picture is honest about
what it is drawn from; the hover text says which.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSplitter, QVBoxLayout, QWidget

from core.devices.cluster import Cluster
from core.devices.profile import Profile
from gui.app import stage_color, style_plot, theme_colors
from gui.studio_state import StudioState
from gui.widgets import panel_header


def device_compute(cluster: Cluster, profile: Profile | None) -> dict[str, tuple[float, str]]:
    """Per device: (a positive compute figure, its human description)."""
    out: dict[str, tuple[float, str]] = {}
    for d in cluster.devices:
        try:
            t = profile.times_of(d.id) if profile is not None else None
        except KeyError:
            t = None
        if t is not None:
            step = sum(t.decode_time(u, 1) for u in range(len(t.decode_s)))
            speed = 1.0 / step if step > 0 else 0.0
            out[d.id] = (speed, f"{speed:.1f} tokens/s for the whole model (profiled, batch 1)")
        else:
            out[d.id] = (float(max(1, d.cores)), f"{d.cores or '?'} cores (not profiled)")
    return out


def link_matrix(cluster: Cluster) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Device ids, bandwidth (Mbit/s) and latency (ms) matrices; NaN where there is no link."""
    ids = list(cluster.device_ids())
    n = len(ids)
    bw = np.full((n, n), np.nan)
    lat = np.full((n, n), np.nan)
    idx = {d: i for i, d in enumerate(ids)}
    for link in cluster.links:
        if link.src in idx and link.dst in idx:
            bw[idx[link.src], idx[link.dst]] = link.bandwidth_mbit_s
            lat[idx[link.src], idx[link.dst]] = link.latency_ms
    return ids, bw, lat


def fmt_mbit(v: float) -> str:
    return f"{v / 1000:.1f} Gbit/s" if v >= 1000 else f"{v:.0f} Mbit/s" if v >= 10 else f"{v:.2f} Mbit/s"


LINK_LABEL_Z = 5
"""Link labels sit above the link lines (z 0) and their midpoint markers."""

class ClusterPanel(QWidget):
    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Cluster", "Devices sized by compute, links drawn by measured bandwidth. "
                                   "Hover a device or a link's midpoint for its figures."))
        self.summary = QLabel("No cluster yet: discover devices or load a profile.")
        self.summary.setProperty("role", "subtitle")
        lay.addWidget(self.summary)
        split = QSplitter(Qt.Horizontal)
        self.graph = pg.PlotWidget()
        self.graph.setAccessibleName("Topology graph")
        self.graph.setToolTip("Devices (node size = compute) and links (line width = bandwidth)")
        self.graph.hideAxis("left")
        self.graph.hideAxis("bottom")
        self.graph.setAspectLocked(True)
        self.graph.setMenuEnabled(False)
        split.addWidget(self.graph)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        self.heatmaps = pg.GraphicsLayoutWidget()
        self.heatmaps.setAccessibleName("Bandwidth and latency heatmaps")
        self.heatmaps.setToolTip("Rows: from; columns: to")
        rl.addWidget(self.heatmaps)
        split.addWidget(right)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        lay.addWidget(split, 1)
        self.node_tips: dict[str, str] = {}
        self.link_tips: dict[tuple[str, str], str] = {}
        self.link_labels: list[pg.TextItem] = []
        """The bandwidth label of each drawn link (on a chip above the line, not struck through by it)."""
        state.cluster_changed.connect(lambda _c: self.refresh())
        state.profile_changed.connect(lambda _p: self.refresh())
        self.refresh()

    def refresh(self) -> None:
        self.graph.clear()
        self.heatmaps.clear()
        style_plot(self.graph)
        style_plot(self.heatmaps)
        self.node_tips.clear()
        self.link_tips.clear()
        self.link_labels.clear()
        cluster = self.state.cluster
        if cluster is None or not cluster.devices:
            self.summary.setText("No cluster yet: discover devices on the Devices screen, or load a profile (Ctrl+Shift+P).")
            return
        c = theme_colors()
        ids, bw, lat = link_matrix(cluster)
        n = len(ids)
        finite = bw[np.isfinite(bw)]
        self.summary.setText(
            f"{n} device(s), {len(cluster.links)} directed link(s)"
            + (f"; bandwidth {fmt_mbit(finite.min())} – {fmt_mbit(finite.max())}" if finite.size else "; no links measured")
        )
        self._draw_graph(cluster, ids, bw, lat, c)
        self._draw_heatmap(0, "Bandwidth (Mbit/s)", ids, bw, "viridis", fmt_mbit)
        self._draw_heatmap(1, "Latency (ms)", ids, lat, "inferno", lambda v: f"{v:.1f} ms")

    def _positions(self, n: int) -> list[tuple[float, float]]:
        if n == 1:
            return [(0.0, 0.0)]
        return [(math.cos(2 * math.pi * i / n + math.pi / 2), math.sin(2 * math.pi * i / n + math.pi / 2)) for i in range(n)]

    def _draw_graph(self, cluster: Cluster, ids, bw, lat, c) -> None:
        pos = self._positions(len(ids))
        compute = device_compute(cluster, self.state.profile)
        max_c = max(v for v, _ in compute.values()) or 1.0
        finite = bw[np.isfinite(bw)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
        mids, mid_tips = [], []
        for i in range(len(ids)):
            for j in range(i + 1, len(ids)):
                ab, ba = bw[i, j], bw[j, i]
                if not (np.isfinite(ab) or np.isfinite(ba)):
                    continue
                best = np.nanmax([ab, ba])
                frac = 0.5 if hi <= lo else (math.log(best) - math.log(lo)) / (math.log(hi) - math.log(lo))
                pen = pg.mkPen(QColor(c["muted"]), width=1.5 + 7 * frac)
                (x0, y0), (x1, y1) = pos[i], pos[j]
                self.graph.addItem(pg.PlotCurveItem([x0, x1], [y0, y1], pen=pen))
                tip = (f"{ids[i]} → {ids[j]}: {fmt_mbit(ab) if np.isfinite(ab) else 'no link'}, "
                       f"{lat[i, j]:.1f} ms\n{ids[j]} → {ids[i]}: {fmt_mbit(ba) if np.isfinite(ba) else 'no link'}, "
                       f"{lat[j, i]:.1f} ms")
                self.link_tips[(ids[i], ids[j])] = tip
                mids.append(((x0 + x1) / 2, (y0 + y1) / 2))
                mid_tips.append(tip)
                # a chip of the background colour above the line: a diagonal line no longer strikes through the text
                label = pg.TextItem(fmt_mbit(best), color=c["muted"], anchor=(0.5, 1.2), fill=pg.mkBrush(c["base"]))
                label.setZValue(LINK_LABEL_Z)
                label.setPos((x0 + x1) / 2, (y0 + y1) / 2)
                self.graph.addItem(label)
                self.link_labels.append(label)
        if mids:
            self.graph.addItem(pg.ScatterPlotItem(
                pos=mids, size=9, brush=pg.mkBrush(c["base"]), pen=pg.mkPen(c["muted"]), data=mid_tips,
                hoverable=True, tip=lambda x, y, data: data, hoverSize=13))
        sizes, brushes, tips = [], [], []
        source = self.state.problem.source if self.state.problem else None
        for i, d in enumerate(cluster.devices):
            value, desc = compute[d.id]
            sizes.append(28 + 50 * math.sqrt(value / max_c))
            brushes.append(pg.mkBrush(stage_color(i)))
            tip = (f"{d.id}\n{desc}\nmemory {d.memory_bytes / 2**30:.1f} GiB"
                   + (f"\n{d.arch}" if d.arch else "") + (f", {d.accelerator}" if d.accelerator else "")
                   + ("\nprompt source" if d.id == source else ""))
            tips.append(tip)
            self.node_tips[d.id] = tip
        self.graph.addItem(pg.ScatterPlotItem(
            pos=pos, size=sizes, brush=brushes, pen=pg.mkPen(c["text"], width=1.5), data=tips,
            hoverable=True, tip=lambda x, y, data: data))
        bold = QFont(self.font())
        bold.setBold(True)
        for (x, y), d in zip(pos, cluster.devices):
            t = pg.TextItem(d.id, color=c["text"], anchor=(0.5, 0.0))
            t.setFont(bold)
            t.setPos(x, y - 0.24)
            self.graph.addItem(t)
        self.graph.setRange(xRange=(-1.5, 1.5), yRange=(-1.5, 1.5), padding=0.05)

    def _draw_heatmap(self, row: int, title: str, ids, m: np.ndarray, cmap: str, fmt) -> None:
        c = theme_colors()
        p = self.heatmaps.addPlot(row=row, col=0, title=title)
        p.setMenuEnabled(False)
        p.setMouseEnabled(False, False)
        p.invertY(True)
        n = len(ids)
        finite = m[np.isfinite(m)]
        # the scale starts at 0 so near-equal links look equal (not min..max stretched)
        lo, hi = 0.0, (float(finite.max()) if finite.size else 1.0)
        img = pg.ImageItem(np.nan_to_num(m.T, nan=lo), levels=(lo, hi if hi > lo else lo + 1))
        img.setColorMap(pg.colormap.get(cmap))
        p.addItem(img)
        for i in range(n):
            for j in range(n):
                v = m[i, j]
                if not np.isfinite(v):
                    blank = pg.QtWidgets.QGraphicsRectItem(j, i, 1, 1)
                    blank.setBrush(pg.mkBrush(c["alt_base"]))
                    blank.setPen(pg.mkPen(None))
                    p.addItem(blank)
                txt = "—" if not np.isfinite(v) else fmt(v)
                bright = np.isfinite(v) and hi > lo and (v - lo) / (hi - lo) > 0.6
                color = "#111111" if bright else "#ffffff" if np.isfinite(v) else c["muted"]
                t = pg.TextItem(txt, color=color, anchor=(0.5, 0.5))
                t.setPos(j + 0.5, i + 0.5)
                p.addItem(t)
        ticks = [[(k + 0.5, d) for k, d in enumerate(ids)]]
        p.getAxis("bottom").setTicks(ticks)
        p.getAxis("left").setTicks(ticks)
        p.setLabel("left", "from")
        p.setLabel("bottom", "to")
        p.setRange(xRange=(0, n), yRange=(0, n), padding=0)
